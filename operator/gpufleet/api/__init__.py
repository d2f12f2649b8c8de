"""The InferenceService API: typed models that generate the CRD schema."""
from .fields import SpecError, parse, to_api
from .v1alpha1 import API_VERSION, GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "InferenceServiceSpec", "SpecError",
           "parse", "parse_spec", "to_api"]


def parse_spec(spec: dict | None) -> InferenceServiceSpec:
    """The spec as typed objects, defaults applied; raises SpecError naming the field."""
    return parse(InferenceServiceSpec, spec, "spec")
