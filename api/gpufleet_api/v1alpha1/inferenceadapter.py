"""The InferenceAdapter kind: a LoRA adapter of an InferenceService, its source, placement and status."""
from __future__ import annotations

from typing import Annotated, Optional

import msgspec
from msgspec import Meta

from gpufleet_api.guard import adapters as adapter_contract
from gpufleet_api.typed import Model

from ..schema import rule
from .common import DNS_LABEL, DNS_SUBDOMAIN, Condition

# --- InferenceAdapter ------------------------------------------------------------------

# The kind's names are the contract's (the router and the guard's docs use them too).
ADAPTER_KIND = adapter_contract.ADAPTER_KIND
ADAPTER_PLURAL = adapter_contract.ADAPTER_PLURAL
ADAPTER_SINGULAR = ADAPTER_KIND.lower()
ADAPTER_SHORT_NAMES = list(adapter_contract.ADAPTER_SHORT_NAMES)
# Clients send an adapter's metadata.name as `model`; the guard keeps it in a folder of that name
# and labels its metrics with it: a DNS label keeps all three safe.
ADAPTER_NAME_MESSAGE = ("an InferenceAdapter's name is what clients send as `model` and must be a DNS label: "
                        "lowercase letters, digits and '-', at most 63 characters, e.g. customer-a")


class AdapterHuggingFaceSource(Model, frozen=True, kw_only=True):
    """An adapter repository on the Hugging Face Hub (a PEFT folder: adapter_config.json and weights)."""
    name: Annotated[str, Meta(
        description="Repository id, e.g. org/customer-a-lora.",
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]
    revision: Optional[Annotated[str, Meta(
        description="Git revision (branch, tag or commit) to fetch. A commit hash pins the adapter. Unset: "
                    "the default branch.",
        min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")]] = None


class AdapterPVCSource(Model, frozen=True, kw_only=True):
    """An adapter folder on a PersistentVolumeClaim, read in place. The claim must be listed in the
    service's spec.engine.lora.adapterClaims (its replicas mount it read-only)."""
    claim_name: Annotated[str, Meta(
        description="Name of the PersistentVolumeClaim in the same namespace.",
        pattern=DNS_SUBDOMAIN, max_length=253)]
    path: Annotated[str, Meta(
        description="Path of the adapter folder inside the volume.",
        pattern=r"^/([^.].*)?$", max_length=1024,
        extra_json_schema={"x-kubernetes-validations": [rule(
            "!self.contains('/../') && !self.endsWith('/..')",
            "source.pvc.path must stay inside the volume: no '..' segments")]})] = "/"


class AdapterSource(Model, frozen=True, kw_only=True):
    """Where the adapter's files come from: exactly one of huggingFace, pvc, uri."""
    __schema__ = {"x_kubernetes_validations": [
        rule("[has(self.huggingFace), has(self.pvc), has(self.uri)].filter(x, x).size() == 1",
             "set exactly one of source.huggingFace, source.pvc, source.uri")]}
    hugging_face: Optional[Annotated[AdapterHuggingFaceSource, Meta(description="Hugging Face Hub source.")]] = None
    pvc: Optional[Annotated[AdapterPVCSource, Meta(description="PersistentVolumeClaim source.")]] = None
    uri: Optional[Annotated[str, Meta(
        description="URL of a tar archive (optionally gzip-compressed) of the adapter folder: http:// or "
                    "https://, at a public address unless the platform admin allows private ones (the chart's "
                    "adapters.allowPrivateSources). Each replica fetches it once, within its share of "
                    "engine.lora.adapterStorage. Credentials and query strings (presigned signatures) are "
                    "never shown in status, Events or logs.",
        min_length=8, max_length=2048, pattern=r"^https?://[^\s/]+/[^\s]*$",
        extra_json_schema={"x-kubernetes-validations": [rule(
            "self.startsWith('http://') || self.startsWith('https://')",
            "source.uri must be an http:// or https:// URL of a tar archive of the adapter folder (file:// is "
            "not fetched); for a folder on a volume use source.pvc, for the Hub source.huggingFace")]})]] = None


class AdapterPlacement(Model, frozen=True, kw_only=True):
    """How many of the service's replicas hold the adapter. Unset bounds: the operator sizes the set by the
    adapter's share of the service's adapter traffic (at least one replica, at most all)."""
    __schema__ = {"x_kubernetes_validations": [
        rule("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
             "placement.minReplicas must be at most placement.maxReplicas", field_path=".minReplicas")]}
    min_replicas: Optional[Annotated[int, Meta(
        description="Fewest replicas holding the adapter (capped at the ready replicas).", ge=1, le=1000)]] = None
    max_replicas: Optional[Annotated[int, Meta(
        description="Most replicas holding the adapter.", ge=1, le=1000)]] = None


class InferenceAdapterSpec(Model, frozen=True, kw_only=True):
    """Desired state of an InferenceAdapter: a LoRA adapter served on an InferenceService's base model."""
    service: Annotated[str, Meta(
        description="Name of the InferenceService (same namespace) whose replicas serve the adapter; it needs "
                    "spec.engine.lora.",
        pattern=DNS_LABEL, max_length=63)]
    source: Annotated[AdapterSource, Meta(description="Where the adapter's files come from.")]
    base_model: Optional[Annotated[str, Meta(
        description="The base model the adapter was trained on, e.g. meta-llama/Llama-3.1-8B-Instruct; the guard "
                    "refuses to load it on another (reason WrongBaseModel). Unset: only the adapter's own "
                    "adapter_config.json is checked.",
        min_length=1, max_length=256)]] = None
    placement: Annotated[AdapterPlacement, Meta(
        description="Bounds on the replicas holding the adapter.")] = msgspec.field(default_factory=AdapterPlacement)


class InferenceAdapterStatus(Model, frozen=True, kw_only=True):
    """Observed state, written by the operator from the replicas' guards."""
    observed_generation: Optional[Annotated[int, Meta(description="Generation of the spec last handled.")]] = None
    loaded_replicas: Optional[Annotated[int, Meta(description="Replicas that have the adapter loaded.")]] = None
    desired_replicas: Optional[Annotated[int, Meta(
        description="Replicas the operator placed the adapter on.")]] = None
    replicas: Annotated[list[str], Meta(
        description="Engine pods that have the adapter loaded; the router sends its requests only there.",
        extra_json_schema={"x-kubernetes-list-type": "set"})] = msgspec.field(default_factory=list)
    requests_per_second: Optional[Annotated[str, Meta(
        description="Requests for the adapter per second over the last minute, all replicas (a decimal, e.g. "
                    "\"2.50\"); a change of 20% or more is written at most every "
                    "--status-figures-interval-seconds, and with every other status change.",
        pattern=r"^[0-9]+(\.[0-9]+)?$")]] = None
    figures_update_time: Optional[Annotated[str, Meta(
        description="When requestsPerSecond last changed in status (RFC 3339).",
        extra_json_schema={
            "format": "date-time",
        },
    )]] = None
    conditions: Annotated[list[Condition], Meta(
        description="Ready: True (reason Loaded) when loaded on a replica and on every replica placed; False "
                    "with Placing, Loading, ServiceNotFound, LoraDisabled or a load failure (SourceUnreachable, "
                    "MissingFiles, RankTooHigh, WrongBaseModel, LoadFailed, TooManyAdapters). NameConflict: True "
                    "(NameClaimedElsewhere) while an object in another namespace owns the adapter's name (the "
                    "router serves that one), False (NameOwned) once it no longer does.",
        extra_json_schema={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )] = msgspec.field(default_factory=list)
