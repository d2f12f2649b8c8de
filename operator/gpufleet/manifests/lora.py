"""spec.engine.lora → the engine pod's adapter folders. Pure.

Each replica's guard fetches the adapters the operator places on it into the
``adapters`` emptyDir (``ADAPTER_DIR``, named to both containers by
``ADAPTER_DIR_ENV``) and hands vLLM the folder; vLLM reads it read-only. The
claims of ``engine.lora.adapterClaims`` are mounted read-only in both
containers at ``ADAPTER_CLAIMS_MOUNT/<claim>``: an InferenceAdapter with
``source.pvc`` is read there in place (``adapter_path``).
"""
from __future__ import annotations

from gpufleet_api.guard.adapters import ADAPTER_DIR, ADAPTER_DIR_ENV, ADAPTER_VOLUME
from gpufleet_api.v1alpha1 import (
    ADAPTER_CLAIM_VOLUME_PREFIX,
    ADAPTER_CLAIMS_MOUNT,
    ADAPTER_STORAGE_MIB,
    InferenceServiceSpec,
)


def enabled(spec: InferenceServiceSpec) -> bool:
    return spec.engine.lora is not None


def storage_limit(spec: InferenceServiceSpec) -> str | None:
    """The adapters emptyDir's size limit: engine.lora.adapterStorage, else maxAdapters x ADAPTER_STORAGE_MIB."""
    lo = spec.engine.lora
    if lo is None:
        return None
    return str(lo.adapter_storage) if lo.adapter_storage is not None else f"{lo.max_adapters * ADAPTER_STORAGE_MIB}Mi"


_SUFFIXES = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
             "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18}


def quantity_bytes(quantity: int | str) -> int | None:
    """A Kubernetes quantity of bytes (``512Mi``, ``2G``, ``1e9``, ``1073741824``); None if it is none."""
    if isinstance(quantity, int):
        return quantity
    text = quantity.strip()
    for suffix, factor in _SUFFIXES.items():
        if text.endswith(suffix) and not text.endswith(f"e{suffix}"):
            number, scale = text[:-len(suffix)], factor
            break
    else:
        number, scale = text, 1
    try:
        return int(float(number) * scale)
    except ValueError:
        return None


def adapter_share_bytes(spec: InferenceServiceSpec) -> int | None:
    """One adapter's share of the adapters emptyDir (``storage_limit`` / maxAdapters): the most bytes
    the guard downloads, and the most it extracts, for one adapter (guard.json ``adapters.maxBytes``)."""
    lo, limit = spec.engine.lora, storage_limit(spec)
    total = quantity_bytes(limit) if limit is not None else None
    if lo is None or total is None:
        return None
    return max(1, total // lo.max_adapters)


def claim_volume(index: int) -> str:
    return f"{ADAPTER_CLAIM_VOLUME_PREFIX}{index}"


def claim_mount(claim: str) -> str:
    return f"{ADAPTER_CLAIMS_MOUNT}/{claim}"


def adapter_path(claim: str, path: str) -> str:
    """Where a replica reads an adapter of ``source.pvc`` (claim, path inside it)."""
    inner = path.strip("/")
    return f"{claim_mount(claim)}/{inner}" if inner else claim_mount(claim)


def _claims(spec: InferenceServiceSpec) -> list[str]:
    lo = spec.engine.lora
    return sorted(set(lo.adapter_claims)) if lo else []


def volumes(spec: InferenceServiceSpec) -> list[dict]:
    if not enabled(spec):
        return []
    return [{"name": ADAPTER_VOLUME, "emptyDir": {"sizeLimit": storage_limit(spec)}},
            *({"name": claim_volume(i), "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
              for i, c in enumerate(_claims(spec)))]


def mounts(spec: InferenceServiceSpec, *, writes: bool) -> list[dict]:
    """``writes``: the guard's container (it fetches into the folder); vLLM's only reads."""
    if not enabled(spec):
        return []
    return [{"name": ADAPTER_VOLUME, "mountPath": ADAPTER_DIR, "readOnly": not writes},
            *({"name": claim_volume(i), "mountPath": claim_mount(c), "readOnly": True}
              for i, c in enumerate(_claims(spec)))]


def env(spec: InferenceServiceSpec) -> list[dict]:
    return [{"name": ADAPTER_DIR_ENV, "value": ADAPTER_DIR}] if enabled(spec) else []
