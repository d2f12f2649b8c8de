"""The real node: a control plane started with ``--real-node`` (a kubelet with
containerd, CNI and kube-proxy beside the kwok nodes) and the images of
``make images`` imported into it.

These tests run as their own pytest session (``make test`` does): the other
tests' host-process operator watches every namespace and would reconcile the
services here too, fighting the in-cluster operator under test.
"""
from __future__ import annotations

import pytest

from tests.support.cluster import session_control_plane


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
