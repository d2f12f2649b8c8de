"""spec.model.cache → where downloaded weights live in the engine pod. Pure.

vLLM downloads Hugging Face weights into ``HF_HOME`` (``/cache/huggingface``).
Without a cache that directory is part of the pod's ``cache`` emptyDir, so
every pod start downloads the model again: the emptyDir then gets a size limit
and an ephemeral-storage request of ``model.cache.ephemeralStorage``, so the
scheduler only places the pod on a node with that much disk. With a
PersistentVolumeClaim or a hostPath the volume ``model-cache`` is mounted over
``HF_HOME``: the first replica (per claim, or per node) downloads, the others
load from disk. The ``model-fetch`` init container downloads (``fetch.py``
in the engine image) and is the only writer: vLLM and the guard mount the
cache read-only and run with ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

from gpufleet_api.v1alpha1 import InferenceServiceSpec

from . import claims, names

HF_HOME = "/cache/huggingface"
VOLUME = "model-cache"
FETCH_CONTAINER = "model-fetch"   # the init container that downloads (gpufleet_engine/launch/fetch.py)


def downloads(spec: InferenceServiceSpec) -> bool:
    """Whether the weights come from the Hub (downloaded by the model-fetch init container) rather
    than being read in place."""
    return not (spec.model.source.pvc or spec.model.source.uri)


def offline_env(spec: InferenceServiceSpec) -> list[dict]:
    """vLLM and the guard read what model-fetch put in the cache, and ask the Hub nothing."""
    return [{"name": "HF_HUB_OFFLINE", "value": "1"}] if downloads(spec) else []


def persistent(spec: InferenceServiceSpec) -> bool:
    cache = spec.model.cache
    return bool(cache.persistent_volume_claim or cache.host_path)


def ephemeral_storage(spec: InferenceServiceSpec) -> str | None:
    """The emptyDir's size when the weights download into it; None when they do not."""
    if downloads(spec) and not persistent(spec):
        return str(spec.model.cache.ephemeral_storage)
    return None


def emptydir(spec: InferenceServiceSpec) -> dict:
    """The pod's ``cache`` emptyDir (vLLM's HOME; the weights too without a persistent cache)."""
    size = ephemeral_storage(spec)
    return {"sizeLimit": size} if size else {}


def requests(spec: InferenceServiceSpec) -> dict[str, str]:
    """The engine container's ephemeral-storage request, when the weights land in the emptyDir."""
    size = ephemeral_storage(spec)
    return {"ephemeral-storage": size} if size else {}


def volumes(service: str, spec: InferenceServiceSpec) -> list[dict]:
    cache = spec.model.cache
    if not downloads(spec):
        return []
    if cache.persistent_volume_claim:
        claim = cache.persistent_volume_claim.claim_name or names.model_cache_claim_name(service)
        return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": claim}}]
    if cache.host_path:
        # Directory, not DirectoryOrCreate: a directory the kubelet creates belongs to root and the
        # engine (uid 65532) could not write it; a missing one fails the pod start with its path.
        return [{"name": VOLUME, "hostPath": {"path": cache.host_path.path, "type": "Directory"}}]
    return []


def mounts(spec: InferenceServiceSpec, *, read_only: bool) -> list[dict]:
    if not (downloads(spec) and persistent(spec)):
        return []
    return [{"name": VOLUME, "mountPath": HF_HOME, "readOnly": read_only}]


def pod_security(spec: InferenceServiceSpec, group: int) -> dict:
    """fsGroup for a claim, so the unprivileged engine can write it; only the top directory's
    ownership is checked at each mount (OnRootMismatch), not every file of a 100 GB cache."""
    if downloads(spec) and spec.model.cache.persistent_volume_claim:
        return {"fsGroup": group, "fsGroupChangePolicy": "OnRootMismatch"}
    return {}


def build_claim(isvc: dict, spec: InferenceServiceSpec) -> dict | None:
    """The claim the operator creates (``persistentVolumeClaim.size`` set), else None."""
    claim = spec.model.cache.persistent_volume_claim
    if claim is None or claim.claim_name or not downloads(spec):
        return None
    return claims.owned_claim(isvc, names.model_cache_claim_name(isvc["metadata"]["name"]), claim)
