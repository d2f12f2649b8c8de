"""Shared fixtures: a session-scoped local control plane (reused when already
up), a fresh namespace per test, and an API client."""
from __future__ import annotations

import os
import uuid

import pytest

from tests.support.cluster import ControlPlane


@pytest.fixture(scope="session")
def control_plane():
    from gpufleet_dev.devcluster import cluster

    started = False
    healthy, _ = cluster.status_report()
    if not healthy:
        if cluster.read_state():
            cluster.down(progress=lambda _m: None)  # a crashed leftover: start clean
        cluster.up(cluster.FleetSpec(engine_nodes=2),
                   progress=lambda m: print(f"[control plane] {m}", flush=True))
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


@pytest.fixture(scope="session")
def crds_installed(control_plane):
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(root / "crds"))
    control_plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                          "crd/inferenceservices.serving.gpufleet.dev")
    return True


@pytest.fixture(scope="session")
def operator(control_plane, crds_installed, tmp_path_factory):
    """The operator, running as its own process for the whole session."""
    from gpufleet_dev.devcluster.operator_process import OperatorProcess
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = OperatorProcess(control_plane.kubeconfig, log, ("--audit-interval-seconds", "2")).start()
    yield proc
    proc.stop()
