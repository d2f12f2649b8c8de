"""The guard token of an operator run as a local process: what the chart's projected volume gives
the operator's pod (a ServiceAccount token for the audience gpufleet-guard), asked of the
TokenRequest API for a ServiceAccount of its own and written to a file for --guard-token-file."""
from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

from gpufleet_api.guard.control_auth import GUARD_AUDIENCE
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import Conflict

NAMESPACE = "default"
SERVICE_ACCOUNT = "gpufleet-dev-operator"
# Longer than any test session or demo: nothing renews this file as the kubelet would.
EXPIRATION_SECONDS = 7 * 24 * 3600


def mint(kubeconfig: str, path: Path, *, namespace: str = NAMESPACE, service_account: str = SERVICE_ACCOUNT,
         expiration_seconds: int = EXPIRATION_SECONDS) -> Path:
    """Write a token of ``namespace``/``service_account`` (created when missing) to ``path``."""
    # On a thread of its own: callers start operators from inside a running event loop (async fixtures),
    # where asyncio.run cannot run.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        token = pool.submit(asyncio.run, _request(KubeConfig.auto(kubeconfig), namespace, service_account,
                                                  expiration_seconds)).result()
    path.write_text(token)
    path.chmod(0o600)
    return path


async def _request(config: KubeConfig, namespace: str, service_account: str, expiration_seconds: int) -> str:
    async with KubeClient(config) as kube:
        try:
            await kube.create({"apiVersion": "v1", "kind": "ServiceAccount",
                               "metadata": {"name": service_account, "namespace": namespace}})
        except Conflict:
            pass  # made by an earlier run
        answer = await kube.request(
            "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                  "spec": {"audiences": [GUARD_AUDIENCE], "expirationSeconds": expiration_seconds}})
    return answer["status"]["token"]
