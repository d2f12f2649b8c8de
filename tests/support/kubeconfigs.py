"""Kubeconfig files and exec credential plugins, as cloud providers' CLIs write them."""
from __future__ import annotations

import stat
import sys
from pathlib import Path

import yaml

PLUGIN = '''#!{python}
"""Prints an ExecCredential, like `aws eks get-token` or `kubelogin get-token`."""
import datetime, json, os, pathlib, sys
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])  # the client's request: apiVersion, interactive
if {exit_code}:
    sys.stderr.write({stderr!r})
    sys.exit({exit_code})
counter = pathlib.Path({counter!r})
runs = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(runs))
token_file = {token_file!r}
status = {{"token": pathlib.Path(token_file).read_text().strip() if token_file else f"token-{{runs}}"}}
expires_in = {expires_in!r}
if expires_in is not None:
    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=expires_in)
    status["expirationTimestamp"] = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential", "status": status}}))
'''


def write_kubeconfig(path: Path, *, server: str = "http://127.0.0.1:6443", user: dict | None = None,
                     cluster: dict | None = None, namespace: str | None = None, name: str = "dev") -> Path:
    ctx = {"cluster": name, "user": name, **({"namespace": namespace} if namespace else {})}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": name,
        "clusters": [{"name": name, "cluster": {"server": server, **(cluster or {})}}],
        "contexts": [{"name": name, "context": ctx}],
        "users": [{"name": name, "user": user or {}}],
    }))
    return path


def exec_plugin(directory: Path, *, token_file: Path | None = None, expires_in: float | None = 3600,
                exit_code: int = 0, stderr: str = "") -> Path:
    """A credential plugin in ``directory``. It prints the token in ``token_file``, or
    token-1, token-2, … (a fresh one per run), with an expiry ``expires_in`` seconds
    ahead; it counts its runs in ``directory/runs``."""
    script = directory / "get-token"
    script.write_text(PLUGIN.format(python=sys.executable, exit_code=exit_code, stderr=stderr,
                                    counter=str(directory / "runs"),
                                    token_file=str(token_file) if token_file else None,
                                    expires_in=expires_in))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def exec_user(script: Path) -> dict:
    return {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": str(script),
                     "interactionMode": "Never"}}


def plugin_runs(directory: Path) -> int:
    runs = directory / "runs"
    return int(runs.read_text()) if runs.exists() else 0


def service_account_kubeconfig(control_plane, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig logging in as ServiceAccount ``namespace/account`` (an hour's token), to the control
    plane's server and CA: a process run with the rights a chart gives that account."""
    from gpufleet_kit.kube.config import KubeConfig
    token = control_plane.kubectl("-n", namespace, "create", "token", account, "--duration=1h").stdout.strip()
    ca = KubeConfig.from_file(control_plane.kubeconfig).ca_file
    return write_kubeconfig(path, server=control_plane.server, user={"token": token},
                            cluster={"certificate-authority": ca}, name="sa")
