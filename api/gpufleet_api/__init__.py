"""The InferenceService API: typed models (msgspec) that generate the CRD schema."""
from __future__ import annotations

from typing import Any, TypeVar

from gpufleet_api import typed

from .errors import ContractError
from .v1alpha1 import API_VERSION, GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "InferenceServiceSpec", "SpecError",
           "parse", "parse_spec", "to_api"]

T = TypeVar("T")


class SpecError(ContractError):
    """An object does not fit its type; ``path`` names the field (spec.autoscaling.maxReplicas)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def parse(cls: type[T], data: Any, path: str = "spec") -> T:
    """Build ``cls`` from an API dict, applying defaults; SpecError names the first wrong field."""
    try:
        return typed.convert(cls, {} if data is None else data)
    except typed.Invalid as e:
        first = e.problems[0]
        raise SpecError(typed.path_of(first.loc, path), first.message) from None


def to_api(value: Any) -> Any:
    """A parsed model (or part of one) back to its API dict form, unset fields left out."""
    return typed.to_builtins(value, omit_none=True)


def parse_spec(spec: dict | None) -> InferenceServiceSpec:
    """The spec as typed objects, defaults applied; raises SpecError naming the field."""
    return parse(InferenceServiceSpec, spec, "spec")
