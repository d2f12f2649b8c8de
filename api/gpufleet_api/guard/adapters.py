"""The guard's adapter endpoint: which LoRA adapters one replica holds.

The operator places each InferenceAdapter on some of its service's replicas
and tells each replica's guard its whole set with ``PUT /adapters`` (an
``AdapterSet``); the guard fetches what is missing, loads it into vLLM through
vLLM's runtime LoRA API, unloads what left the set, and answers ``GET
/adapters`` with an ``AdapterReport``. The set is declarative: sending the same
one twice changes nothing, and a replica that restarted (empty set) gets its
adapters back on the operator's next pass. The router sends ``model: <name>``
only to replicas whose report (or ``gpufleet_guard_adapter_state``) says
``Loaded``.

Each adapter a guard reports carries the digest of the spec it holds under that name
(``spec_digest``: its source, base model and name, as the operator sent them); the operator
sends a replica its set again when a digest differs from what it wants there, not only when the
names differ.
"""
from __future__ import annotations

import hashlib
import json
from typing import Literal, Optional

import msgspec

from .. import typed

ADAPTERS_PATH = "/adapters"

# Where a replica keeps fetched adapters: the operator mounts an emptyDir named ADAPTER_VOLUME at
# ADAPTER_DIR in the engine container and sets ADAPTER_DIR_ENV; the guard fetches each adapter
# once into ADAPTER_DIR/<name>/ and hands vLLM that folder. A ``path`` source is read in place.
ADAPTER_DIR_ENV = "GPUFLEET_ADAPTER_DIR"
ADAPTER_DIR = "/var/lib/gpufleet/adapters"
ADAPTER_VOLUME = "adapters"

# The InferenceAdapter resource (api/gpufleet_api/v1alpha1/inferenceadapter.py declares it), named here so
# the router and the guard's docs need not import the operator's API.
ADAPTER_KIND = "InferenceAdapter"
ADAPTER_PLURAL = "inferenceadapters"
ADAPTER_SHORT_NAMES = ("iad",)

AdapterStateName = Literal["Fetching", "Loading", "Loaded", "Failed", "Unloading"]
# Why an adapter failed, as the InferenceAdapter's condition reason and the metric's label.
FailureReason = Literal["SourceUnreachable", "MissingFiles", "RankTooHigh", "WrongBaseModel",
                        "LoadFailed", "TooManyAdapters"]
FAILURE_REASONS: tuple[str, ...] = FailureReason.__args__  # type: ignore[attr-defined]


class _Doc(typed.Model, frozen=True, forbid_unknown_fields=True):
    pass


class HuggingFaceAdapterSource(_Doc, frozen=True):
    name: str                       # the Hub repository, e.g. "org/customer-a-lora"
    revision: Optional[str] = None  # branch, tag or commit; None: the default branch


class AdapterSource(_Doc, frozen=True):
    """Exactly one of: a Hub repository, a folder inside the pod (a mounted claim), or a URL of
    a tar archive of the adapter's folder (http or https; ``file://`` is refused, a mounted claim is a
    ``path``). Each is untrusted input: the guard bounds its fetch (guard.json ``adapters``)."""
    hugging_face: Optional[HuggingFaceAdapterSource] = msgspec.field(default=None, name="huggingFace")
    path: Optional[str] = None
    uri: Optional[str] = None


class AdapterSpec(_Doc, frozen=True):
    name: str                 # what clients send as ``model``
    source: AdapterSource
    # The base model the adapter was trained on, when its author said (InferenceAdapter
    # spec.baseModel); the guard also compares adapter_config.json's base_model_name_or_path.
    base_model: Optional[str] = None


class AdapterSet(_Doc, frozen=True):
    adapters: tuple[AdapterSpec, ...] = ()


def spec_digest(spec: AdapterSpec) -> str:
    """``sha256:<hex>`` over the spec's canonical JSON: equal exactly when name, source and base
    model are. One-way: a presigned URI's signature cannot be read back from it."""
    canonical = json.dumps(typed.to_builtins(spec, omit_none=True), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


class AdapterState(_Doc, frozen=True):
    name: str
    state: AdapterStateName
    reason: Optional[FailureReason] = None
    message: str = ""
    rank: Optional[int] = None
    since: float = 0.0        # unix time of the last state change
    # spec_digest of what the replica holds under this name; "" from a guard that reports none.
    digest: str = ""


class AdapterReport(_Doc, frozen=True):
    adapters: tuple[AdapterState, ...] = ()
    max_adapters: int = 0     # engine.lora.maxAdapters; 0: LoRA is off on this replica
    max_loras: int = 0        # adapters per batch (GPU slots)
    max_cpu_loras: int = 0    # vLLM's CPU-side adapter cache
