"""Every manifest in samples/ is an example that works: the API server accepts
it as written, keeps every field it sets (a misspelt or misplaced field would
be pruned by the CRD's structural schema without a word), and the operator
reconciles it into a Ready condition that is not InvalidSpec.

Parametrized over the folder, so a new sample is covered by being added.
The namespace allows no pods: the objects are reconciled, but no engine is
started (local-tiny.yaml would otherwise start real vLLM processes)."""
from pathlib import Path

import pytest
import yaml

from gpufleet.reconcile import conditions as c
from tests.support.waiting import wait_for

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
MANIFESTS = sorted([*SAMPLES.glob("*.yaml"), *SAMPLES.glob("*.yml")])
_MISSING = object()


def lost_fields(sent, stored, path: str) -> list[str]:
    """Paths of values in ``sent`` that ``stored`` does not hold as sent (defaults may be added)."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [path]
        return [p for k, v in sent.items() for p in lost_fields(v, stored.get(k, _MISSING), f"{path}.{k}")]
    if isinstance(sent, list):
        if not isinstance(stored, list) or len(stored) != len(sent):
            return [path]
        return [p for i, (a, b) in enumerate(zip(sent, stored, strict=True)) for p in lost_fields(a, b, f"{path}[{i}]")]
    return [] if sent == stored else [f"{path} (sent {sent!r}, stored {stored!r})"]


def test_the_samples_folder_has_manifests():
    assert MANIFESTS, f"no *.yaml in {SAMPLES}"


@pytest.fixture
async def podless_namespace(kube, namespace):
    await kube.create({"apiVersion": "v1", "kind": "ResourceQuota",
                       "metadata": {"name": "no-pods", "namespace": namespace}, "spec": {"hard": {"pods": "0"}}})
    return namespace


async def reconciled_ready(kube, api: str, kind: str, name: str, namespace: str, sample: str) -> dict:
    """The Ready condition, once the operator has written it for the current generation."""
    async def reconciled():
        o = await kube.get(api, kind, name, namespace)
        st = o.get("status") or {}
        ready = c.get(st.get("conditions"), c.READY)
        return ready if ready and st.get("observedGeneration") == o["metadata"]["generation"] else None

    async def describe():
        return (await kube.get(api, kind, name, namespace)).get("status")

    return await wait_for(reconciled, timeout=60, what=f"{sample}: {kind}/{name} reconciled", describe=describe)


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
async def test_sample_is_accepted_kept_and_reconciled(path, control_plane, operator, kube, podless_namespace):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path.name} holds no object"
    applied = control_plane.kubectl("apply", "-n", podless_namespace, "-f", str(path), check=False)
    assert applied.returncode == 0, f"the API server refused {path.name}:\n{applied.stderr}"

    for doc in docs:
        api, kind, name = doc["apiVersion"], doc["kind"], doc["metadata"]["name"]
        stored = await kube.get(api, kind, name, podless_namespace)
        lost = lost_fields({k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")},
                           stored, kind)
        assert not lost, f"{path.name}: the API server did not keep {lost}"
        if kind != "InferenceService":
            continue

        ready = await reconciled_ready(kube, api, kind, name, podless_namespace, path.name)
        assert ready["reason"] != "InvalidSpec", f"{path.name}: {ready['message']}"
