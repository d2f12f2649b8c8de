"""Where the Kubernetes API is and how to authenticate to it.

Reads a kubeconfig file (client certificates or bearer tokens, files or inline
data) or the in-cluster service-account mount. Inline data is written to a
private temporary directory because ``ssl`` only loads certificates from files.
"""
from __future__ import annotations

import base64
import dataclasses
import os
import ssl
import tempfile
from pathlib import Path

import yaml

IN_CLUSTER_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(Exception):
    """The kubeconfig or in-cluster credentials are missing or unusable."""


@dataclasses.dataclass(frozen=True)
class KubeConfig:
    server: str
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None
    token_file: str | None = None
    namespace: str = "default"
    insecure: bool = False

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def bearer_token(self) -> str | None:
        # Projected service-account tokens rotate: re-read the file each time.
        if self.token_file:
            return Path(self.token_file).read_text().strip()
        return self.token

    @classmethod
    def in_cluster(cls) -> "KubeConfig":
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (IN_CLUSTER_DIR / "token").exists():
            raise KubeConfigError("not running inside a Kubernetes pod")
        ns_file = IN_CLUSTER_DIR / "namespace"
        return cls(
            server=f"https://{host}:{port}",
            ca_file=str(IN_CLUSTER_DIR / "ca.crt"),
            token_file=str(IN_CLUSTER_DIR / "token"),
            namespace=ns_file.read_text().strip() if ns_file.exists() else "default",
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike, context: str | None = None) -> "KubeConfig":
        path = Path(path).expanduser()
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise KubeConfigError(f"kubeconfig {path} does not exist") from None
        ctx_name = context or doc.get("current-context")
        ctx = _named(doc.get("contexts"), ctx_name, "context", path)
        cluster = _named(doc.get("clusters"), ctx.get("cluster"), "cluster", path)
        user = _named(doc.get("users"), ctx.get("user"), "user", path)
        base = path.parent
        return cls(
            server=cluster["server"],
            ca_file=_file_or_data(cluster, "certificate-authority", base),
            cert_file=_file_or_data(user, "client-certificate", base),
            key_file=_file_or_data(user, "client-key", base),
            token=user.get("token"),
            token_file=user.get("tokenFile"),
            namespace=ctx.get("namespace", "default"),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
        )

    @classmethod
    def auto(cls, kubeconfig: str | None = None) -> "KubeConfig":
        """Explicit path, then $KUBECONFIG, then in-cluster, then ~/.kube/config."""
        if kubeconfig:
            return cls.from_file(kubeconfig)
        env = os.environ.get("KUBECONFIG")
        if env:
            return cls.from_file(env.split(os.pathsep)[0])
        try:
            return cls.in_cluster()
        except KubeConfigError:
            return cls.from_file("~/.kube/config")


def _named(items, name, what, path) -> dict:
    for item in items or []:
        if item.get("name") == name:
            return item.get(what) or {}
    raise KubeConfigError(f"kubeconfig {path}: no {what} named {name!r}")


_inline_dir: str | None = None


def _file_or_data(section: dict, key: str, base: Path) -> str | None:
    global _inline_dir
    if section.get(key):
        p = Path(section[key])
        return str(p if p.is_absolute() else base / p)
    data = section.get(f"{key}-data")
    if not data:
        return None
    if _inline_dir is None:
        _inline_dir = tempfile.mkdtemp(prefix="gpufleet-kubeconfig-")
    out = Path(_inline_dir) / f"{key}-{abs(hash(data))}.pem"
    out.write_bytes(base64.b64decode(data))
    out.chmod(0o600)
    return str(out)
