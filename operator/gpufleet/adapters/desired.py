"""What each replica should hold: one ``AdapterSet`` per ready replica. Pure.

From the service's adapters, the replicas' reports (what they hold now) and the
adapters' request rates, ``plan`` asks ``placement.place`` for the holders of each
adapter and turns the answer into the documents ``PUT /adapters`` takes. An
adapter that cannot be placed at all is left out with the reason its status
will show: a spec the types refuse, or a ``source.pvc`` claim the service's
replicas do not mount (``engine.lora.adapterClaims``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from gpufleet_api.guard.adapters import (
    AdapterReport,
    AdapterSet,
    AdapterSource,
    AdapterSpec,
    HuggingFaceAdapterSource,
    spec_digest,
)
from gpufleet_api.v1alpha1 import InferenceAdapterSpec, LoraSpec

from ..manifests import lora as lora_layout
from .index import Adapter
from .placement import Placement, place

# The states in which a replica holds an adapter now (a move away costs a load elsewhere).
HELD_STATES = ("Fetching", "Loading", "Loaded", "Failed")


@dataclass(frozen=True)
class Refusal:
    reason: str   # the Ready condition's reason
    message: str


@dataclass
class Plan:
    sets: dict[str, AdapterSet]                 # replica → its whole set
    placement: Placement
    refused: dict[str, Refusal] = field(default_factory=dict)   # adapter → why it is placed nowhere

    def holders(self, adapter: str) -> list[str]:
        return list(self.placement.holders.get(adapter, ()))


def source_of(spec: InferenceAdapterSpec, lora: LoraSpec) -> AdapterSource | Refusal:
    """The source as the guard takes it; a pvc claim the replicas do not mount is a Refusal."""
    src = spec.source
    if src.hugging_face is not None:
        return AdapterSource(hugging_face=HuggingFaceAdapterSource(name=src.hugging_face.name,
                                                                   revision=src.hugging_face.revision))
    if src.pvc is not None:
        if src.pvc.claim_name not in lora.adapter_claims:
            return Refusal("SourceUnreachable",
                           f"claim {src.pvc.claim_name} is not mounted by the service's replicas: add it to the "
                           f"InferenceService's spec.engine.lora.adapterClaims (this restarts its replicas)")
        return AdapterSource(path=lora_layout.adapter_path(src.pvc.claim_name, src.pvc.path))
    if src.uri is not None:
        return AdapterSource(uri=src.uri)
    return Refusal("SourceUnreachable", "spec.source sets none of huggingFace, pvc, uri")


def held_now(reports: Mapping[str, AdapterReport | None]) -> dict[str, set[str]]:
    """adapter → replicas whose report holds it now."""
    out: dict[str, set[str]] = {}
    for replica, report in reports.items():
        for a in (report.adapters if report else ()):
            if a.state in HELD_STATES:
                out.setdefault(a.name, set()).add(replica)
    return out


def plan(adapters: Sequence[Adapter], replicas: Sequence[str], lora: LoraSpec,
         reports: Mapping[str, AdapterReport | None], rates: Mapping[str, float]) -> Plan:
    """``replicas``: the ready replicas, in a stable order; ``reports``: each one's last report
    (None: unreadable now, its current holdings unknown)."""
    specs: dict[str, AdapterSpec] = {}
    refused: dict[str, Refusal] = {}
    bounds: dict[str, tuple[int, int]] = {}
    for a in adapters:
        if a.spec is None:
            refused[a.name] = Refusal("InvalidSpec", "spec does not fit the InferenceAdapter type")
            continue
        source = source_of(a.spec, lora)
        if isinstance(source, Refusal):
            refused[a.name] = source
            continue
        specs[a.name] = AdapterSpec(name=a.name, source=source, base_model=a.spec.base_model)
        p = a.spec.placement
        if p.min_replicas is not None or p.max_replicas is not None:
            bounds[a.name] = (p.min_replicas or 1, p.max_replicas or max(len(replicas), 1))
    capacity = lora.cpu_cache_adapters or lora.max_adapters_per_batch
    placed = place({name: rates.get(name, 0.0) for name in specs}, list(replicas), capacity,
                   current=held_now(reports), bounds=bounds, limit=lora.max_adapters)
    sets = {r: AdapterSet(adapters=tuple(specs[a] for a in placed.adapters_on(r))) for r in replicas}
    return Plan(sets=sets, placement=placed, refused=refused)


def needs_put(report: AdapterReport | None, wanted: AdapterSet) -> bool:
    """Whether a replica must be told its set: what it reports (leaving aside what it is unloading)
    is not what it should hold, by name and by the digest of each adapter's source
    (``spec_digest``): a replica serving another source under a wanted name gets its set again.
    A restarted replica reports nothing, so it gets its set again."""
    if report is None:
        return False  # unreadable: no knowing what it holds; the next read decides
    holds = {a.name: a.digest for a in report.adapters if a.state != "Unloading"}
    if holds.keys() != {a.name for a in wanted.adapters}:
        return True
    # A guard from before digests reports "": its names are all there is to compare.
    return any(holds[a.name] and holds[a.name] != spec_digest(a) for a in wanted.adapters)
