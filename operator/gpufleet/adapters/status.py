"""An InferenceAdapter's status from its placement and the replicas' reports. Pure.

Ready is True (reason Loaded) once the adapter is loaded on at least one replica
and on every replica it is placed on. Otherwise False, with the first of:
ServiceNotFound, LoraDisabled, the refusal of ``desired.plan`` (SourceUnreachable
for an unmounted claim), TooManyAdapters (no replica has room), the failure a
replica's guard reports (SourceUnreachable, MissingFiles, RankTooHigh,
WrongBaseModel, LoadFailed, TooManyAdapters) with its message, Loading while a
replica fetches or loads it, Placing while no replica is ready or has reported it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from gpufleet_api import redact
from gpufleet_api.guard.adapters import AdapterReport, AdapterState

from ..reconcile import conditions as cond
from .desired import Refusal

LOADED, PLACING, LOADING = "Loaded", "Placing", "Loading"
SERVICE_NOT_FOUND, LORA_DISABLED, TOO_MANY = "ServiceNotFound", "LoraDisabled", "TooManyAdapters"
RATE = "requestsPerSecond"  # the adapter's one figure: paced (reconcile.figures), the rest written at once
# A rate change smaller than this share (or than MIN_RATE_CHANGE) is not worth a status write.
RATE_CHANGE = 0.2
MIN_RATE_CHANGE = 0.05


@dataclass(frozen=True)
class Observed:
    """What one adapter's status is made of."""
    holders: Sequence[str] = ()                               # replicas placed on (desired)
    reports: Mapping[str, AdapterReport | None] | None = None  # ready replica → its report
    rate: float | None = None                                 # requests per second, every replica
    refusal: Refusal | None = None                            # why it is placed nowhere


def service_not_found(service: str, namespace: str, generation: int | None) -> dict:
    return _status(generation, cond.condition(
        cond.READY, False, SERVICE_NOT_FOUND,
        f"InferenceService {service} not found in namespace {namespace}: create it, or set spec.service to an "
        f"existing one", generation=generation))


def lora_disabled(service: str, generation: int | None) -> dict:
    return _status(generation, cond.condition(
        cond.READY, False, LORA_DISABLED,
        f"InferenceService {service} does not serve LoRA adapters: set its spec.engine.lora (this restarts "
        f"its replicas)", generation=generation))


def _status(generation: int | None, ready: dict, **fields) -> dict:
    return {"observedGeneration": generation, "loadedReplicas": 0, "desiredReplicas": 0, "replicas": [],
            **fields, "conditions": [ready]}


def _state(report: AdapterReport | None, name: str) -> AdapterState | None:
    return next((a for a in (report.adapters if report else ()) if a.name == name), None)


def adapter_status(name: str, service: str, generation: int | None, seen: Observed) -> dict:
    """The status fields (conditions without lastTransitionTime: ``merged`` adds it)."""
    reports = seen.reports or {}
    states = {r: _state(rep, name) for r, rep in reports.items()}
    loaded = sorted(r for r, s in states.items() if s is not None and s.state == "Loaded")
    failed = sorted((r, s) for r, s in states.items() if s is not None and s.state == "Failed")
    loading = sorted(r for r, s in states.items() if s is not None and s.state in ("Fetching", "Loading"))
    holders = list(seen.holders)
    fields = {"loadedReplicas": len(loaded), "desiredReplicas": len(holders), "replicas": loaded}
    if seen.rate is not None:
        fields[RATE] = f"{seen.rate:.2f}"

    def ready(ok: bool, reason: str, message: str) -> dict:
        return _status(generation, cond.condition(cond.READY, ok, reason, message, generation=generation), **fields)

    if seen.refusal is not None:
        return ready(False, seen.refusal.reason, redact.text(seen.refusal.message))
    if failed:
        replica, state = failed[0]
        others = f" (and on {', '.join(r for r, _ in failed[1:])})" if len(failed) > 1 else ""
        # A guard's message may name the source: never its credentials or a presigned signature.
        return ready(False, state.reason or "LoadFailed",
                     f"{replica}: {redact.text(state.message or state.reason or '')}{others}")
    if not reports:
        return ready(False, PLACING, f"waiting for a ready replica of InferenceService {service}")
    if not holders:
        return ready(False, TOO_MANY, f"no replica of InferenceService {service} has room for another adapter: "
                                      f"raise its spec.engine.lora.maxAdapters or its replicas, or remove adapters")
    missing = [r for r in holders if r not in loaded]
    if loaded and not missing:
        return ready(True, LOADED, f"loaded on {', '.join(loaded)}")
    have = f"; loaded on {', '.join(loaded)}" if loaded else ""
    if loading:
        return ready(False, LOADING, f"loading on {', '.join(loading)}{have}")
    return ready(False, PLACING, f"placed on {', '.join(holders)}, waiting for them to report it{have}")


def _ready(status: dict) -> dict:
    return cond.get(status.get("conditions"), cond.READY) or {}


def failure_reason(status: dict) -> str | None:
    """The Ready reason when it reports a problem (False and not just on its way)."""
    c = _ready(status)
    if c.get("status") == "False" and c.get("reason") not in (PLACING, LOADING):
        return c.get("reason")
    return None


def differs(old: dict, new: dict) -> bool:
    """Whether ``new`` says something other than ``old`` (the object's current status) besides its
    request rate: written at once."""
    for key in ("observedGeneration", "loadedReplicas", "desiredReplicas"):
        if old.get(key) != new.get(key):
            return True
    if sorted(old.get("replicas") or []) != sorted(new.get("replicas") or []):
        return True
    for type_ in (cond.READY, cond.NAME_CONFLICT):
        o, n = cond.get(old.get("conditions"), type_) or {}, cond.get(new.get("conditions"), type_)
        if type_ == cond.NAME_CONFLICT and n is None:
            continue   # not said: the one written stands (merged keeps it)
        n = n or {}
        if any(o.get(k) != n.get(k) for k in ("status", "reason", "message", "observedGeneration")):
            return True
    return False


def rate_moved(old: dict, new: dict) -> bool:
    """Whether the request rate moved enough to be worth a status write of its own (when one is due)."""
    if RATE not in new:
        return False
    before, after = float(old.get(RATE) or 0), float(new[RATE])
    change = abs(after - before)
    return change >= MIN_RATE_CHANGE and change >= RATE_CHANGE * max(before, after)


def merged(old: dict, new: dict, now: str) -> dict:
    """``new`` as written: its Ready condition keeps its lastTransitionTime while its status holds."""
    return {**new, "conditions": cond.merge(old.get("conditions") or [], new["conditions"], now)}
