"""Shared fixtures: a session-scoped local control plane (reused when already
up), a fresh namespace per test, and an API client."""
from __future__ import annotations

import os
import uuid

import pytest

from tests.support.cluster import ControlPlane


@pytest.fixture(scope="session")
def control_plane():
    from gpufleet.devcluster import cluster

    started = False
    healthy, _ = cluster.status_report()
    if not healthy:
        if cluster.read_state():
            cluster.down(progress=lambda _m: None)  # a crashed leftover: start clean
        cluster.up(progress=lambda m: print(f"[control plane] {m}", flush=True))
        started = True
    state = cluster.read_state()
    yield ControlPlane(kubeconfig=state["kubeconfig"], server=state["server"])
    if started and os.environ.get("GPUFLEET_KEEP_CLUSTER") != "1":
        cluster.down(progress=lambda _m: None)


@pytest.fixture
async def kube(control_plane):
    client = control_plane.client()
    yield client
    await client.close()


@pytest.fixture
async def namespace(control_plane, kube):
    name = f"t-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": name, "labels": {"gpufleet.dev/test": "true"}}})
    yield name
    await kube.delete("v1", "Namespace", name)


def pytest_collection_modifyitems(config, items):
    # Tests that need the control plane are marked by where they live.
    for item in items:
        path = str(item.fspath)
        if "/tests/integration/" in path:
            item.add_marker(pytest.mark.integration)
        elif "/tests/e2e/" in path:
            item.add_marker(pytest.mark.e2e)
