"""ServiceAccounts for the real node's host processes (kube-network-policies, CoreDNS).

On a real cluster both run as pods with a ServiceAccount and the RBAC of their
install manifests; here they run as host processes with the same identity: a
ServiceAccount in ``kube-system``, a ClusterRole with their rules, and a token
from the TokenRequest API written where the process reads it. The objects are
pure (``account_objects``); ``issue`` applies them and writes the token.
"""
from __future__ import annotations

from pathlib import Path

NAMESPACE = "kube-system"
# A token for the cluster's lifetime (every `up` issues new ones); the API server caps it at its maximum.
TOKEN_SECONDS = 7 * 24 * 3600


def account_objects(name: str, rules: list[dict]) -> list[dict]:
    """The ServiceAccount, its ClusterRole and their binding."""
    labels = {"app.kubernetes.io/managed-by": "gpufleet-dev"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": f"gpufleet-dev:{name}", "labels": labels}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"gpufleet-dev:{name}", "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"gpufleet-dev:{name}"},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]},
    ]


def issue(kubeconfig: str, name: str, rules: list[dict], dest: Path, ca: Path) -> Path:
    """Apply the account and write ``token``, ``ca.crt`` and ``namespace`` into ``dest`` (the
    layout of a pod's ``/var/run/secrets/kubernetes.io/serviceaccount``); returns ``dest``."""
    import asyncio
    import shutil

    from gpufleet_kit.kube.client import KubeClient
    from gpufleet_kit.kube.config import KubeConfig

    async def go() -> str:
        async with KubeClient(KubeConfig.from_file(kubeconfig)) as kube:
            for obj in account_objects(name, rules):
                await kube.apply(obj, field_manager="gpufleet-dev")
            path = await kube.path("v1", "ServiceAccount", NAMESPACE, name, "token")
            out = await kube.request("POST", path, body={
                "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": TOKEN_SECONDS}})
            return out["status"]["token"]
    token = asyncio.run(go())
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "token").write_text(token)
    (dest / "token").chmod(0o600)
    shutil.copyfile(ca, dest / "ca.crt")
    (dest / "namespace").write_text(NAMESPACE)
    return dest
