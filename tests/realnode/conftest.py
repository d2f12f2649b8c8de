"""The real node: a control plane started with ``--real-node`` (a kubelet with
containerd, CNI, kube-proxy, kube-network-policies and CoreDNS beside the kwok
nodes) and the images of ``make images`` imported into it; the product installed
there once for the session (``install``: the chart; ``service``: the tiny sample).

These tests run as their own pytest session (``make test`` does): the other
tests' host-process operator watches every namespace and would reconcile the
services here too, fighting the in-cluster operator under test.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from urllib.parse import urlsplit

import pytest
import yaml

from gpufleet_dev.devcluster import node
from gpufleet_dev.devcluster.binaries import ensure_helm
from tests.realnode.product import (
    ROOT,
    Install,
    _cluster_ip,
    _delete_leftover_cluster_objects,
    _sample,
    _service_ready,
)
from tests.support.cluster import session_control_plane
from tests.support.waiting import wait_for


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A real-node test that failed (or failed as expected) reports what the node's network did."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "call" and call.excinfo is not None:
        from gpufleet_dev.devcluster.layout import state_dir
        from tests.realnode.diagnostics import node_network_report
        report.sections.append(("the real node's network", node_network_report(state_dir() / "state.json")))


@pytest.fixture(scope="session")
def control_plane():
    """Reuses a running control plane that has the real node; otherwise (re)starts one with it.

    A running one without the real node is restarted at once (down, then up with
    ``--engine-nodes 2 --real-node``, what the other tests' fixture expects too) and left up.
    """
    from gpufleet_dev.devcluster import images

    stale = [name for name, image in images.current().items() if not image["cached"]]
    if stale:  # `make test` builds them first; a tree edited since runs the last build
        print(f"[control plane] images {stale} are older than the sources; testing the last build", flush=True)
    yield from session_control_plane(lambda state: bool(state.get("fleet", {}).get("real_node")), real_node=True)


@pytest.fixture(scope="session")
def built_images(control_plane) -> dict[str, str]:
    """image name -> the ref imported into the real node's containerd: the last built ones, imported
    now when the running node lacks them (a rebuild since `gpufleet dev up`)."""
    from gpufleet_dev.devcluster import cluster
    return cluster.refresh_real_node_images(progress=lambda m: print(f"[real node] {m}", flush=True))


@pytest.fixture(scope="session")
def install(control_plane, built_images, crds_installed):
    """The chart in a namespace that enforces the `restricted` Pod Security Standard, the
    operator watching one workload namespace, scheduled on the real node. The tree's CRDs are applied
    first (``crds_installed``): helm installs a chart's CRDs only where none exist, and a CRD of an older
    tree would prune the fields it does not know from every spec the tests write."""
    suffix = uuid.uuid4().hex[:6]
    inst = Install(f"rn-operator-{suffix}", f"rn-work-{suffix}", str(ensure_helm(progress=print)))
    _delete_leftover_cluster_objects(control_plane)
    control_plane.kubectl("create", "namespace", inst.operator_ns)
    control_plane.kubectl("label", "namespace", inst.operator_ns, "pod-security.kubernetes.io/enforce=restricted")
    control_plane.kubectl("create", "namespace", inst.work_ns)
    # Values as JSON: helm reads YAML 1.2, where a hex tag like 0635778304e6 unquoted is a number.
    repo, tag = built_images["operator"].rsplit(":", 1)
    values = {
        "image": {"repository": repo, "tag": tag, "pullPolicy": "IfNotPresent"},
        "replicaCount": 1, "watchNamespaces": [inst.work_ns],
        "operator": {"auditIntervalSeconds": 5},
        "nodeSelector": {"kubernetes.io/hostname": node.NODE_NAME},
        # The API server's own port: the policies' egress names it, as on a cluster where it is 6443.
        "networkPolicy": {"apiServer": {"ports": [urlsplit(control_plane.server).port]}},
        "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
        # test_lora.py serves its adapter archives from this host's private address: allowed here only.
        "adapters": {"allowPrivateSources": True},
        # The router's two pods on the real node too, small enough to leave room for two engines (2 x 750m,
        # and the operator's 100m, of 2 cores). Not less: the CPU weight follows the request, and at 50m a
        # router relaying four streams beside two busy engines answered its probes too late to stay up.
        "router": {"nodeSelector": {"kubernetes.io/hostname": node.NODE_NAME},
                   "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
                   "resources": {"requests": {"cpu": "150m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}},
    }
    env = control_plane.env()
    # Not --wait: helm deletes every object of the release either way; waiting for the operator's and the
    # routers' pods to finish terminating (their drains) took 30 s of the tier and nothing after it needs
    # them gone (a next session's namespaces have their own suffix; its install clears what is left).
    subprocess.run([inst.helm, "uninstall", "gpufleet", "-n", inst.operator_ns], env=env, capture_output=True)
    out = subprocess.run([inst.helm, "install", "gpufleet", str(ROOT / "charts" / "gpufleet"), "-n", inst.operator_ns,
                          "-f", "-"], input=json.dumps(values), env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    yield inst
    control_plane.kubectl("delete", "namespace", inst.work_ns, "--wait=false", check=False)
    # Not --wait: helm deletes every object of the release either way; waiting for the operator's and the
    # routers' pods to finish terminating (their drains) took 30 s of the tier and nothing after it needs
    # them gone (a next session's namespaces have their own suffix; its install clears what is left).
    subprocess.run([inst.helm, "uninstall", "gpufleet", "-n", inst.operator_ns], env=env,
                   capture_output=True, timeout=120)
    control_plane.kubectl("delete", "namespace", inst.operator_ns, "--wait=false", check=False)



@pytest.fixture(scope="session")
def service(install, control_plane, built_images):
    """The real-node tiny sample, Ready with one replica; yields its ClusterIP."""
    control_plane.kubectl("apply", "-n", install.work_ns, "-f", "-",
                          input=yaml.safe_dump(_sample(built_images["engine-cpu"])))

    async def ready() -> str:
        kube = control_plane.client()
        try:
            await wait_for(lambda: _service_ready(kube, install.work_ns, 1), timeout=420,
                           what="the tiny engine pod Ready on the real node",
                           describe=lambda: control_plane.kubectl("-n", install.work_ns, "describe", "pods",
                                                                  check=False).stdout[-4000:])
            return await _cluster_ip(kube, install.work_ns)
        finally:
            await kube.close()
    return asyncio.run(ready())
