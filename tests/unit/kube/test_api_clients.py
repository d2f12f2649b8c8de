"""Who talks to the API server (docs/operator-design.md, "Clients of the API server"): the operator's
KubeClient for every request it makes, kopf's client for kopf's watches only. The kubernetes package
only LOADS credentials (kubeconfig, exec plugins, OIDC, in-cluster); it never sends a request."""
from __future__ import annotations

import ast
from pathlib import Path

import gpufleet
import gpufleet_dev
import gpufleet_kit
import gpufleet_router
from gpufleet_kit.kube.config import KubeConfig

PACKAGES = [Path(m.__file__).parent for m in (gpufleet, gpufleet_kit, gpufleet_router, gpufleet_dev)]
LOADERS = {"kubernetes.client": {"Configuration"}, "kubernetes.config.config_exception": {"ConfigException"},
           "kubernetes.config.kube_config": {"KubeConfigLoader", "KubeConfigMerger"},
           "kubernetes.config.incluster_config": {"InClusterConfigLoader"}}


def imports(top: str) -> list[tuple[str, str, set[str]]]:
    """(file relative to its package's parent, module, names) of every import of ``top``."""
    found = []
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found += [(str(path.relative_to(package.parent)), a.name, set()) for a in node.names
                              if a.name.split(".")[0] == top]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] == top:
                    found.append((str(path.relative_to(package.parent)), node.module, {a.name for a in node.names}))
    return found


def test_the_kubernetes_package_is_used_for_its_credential_loaders_alone():
    used = imports("kubernetes")
    assert used and {file for file, _, _ in used} == {"gpufleet_kit/kube/config.py"}
    for _, module, names in used:
        assert module in LOADERS and names <= LOADERS[module], (module, names)


def test_kopf_is_imported_by_the_watch_wiring_and_the_command_that_starts_it_only():
    assert {file for file, _, _ in imports("kopf")} == {"gpufleet/wiring/handlers.py", "gpufleet/cli/run.py"}


def test_loading_credentials_builds_no_kubernetes_api_client(tmp_path, monkeypatch):
    from kubernetes.client import api_client

    def refuse(*_args, **_kwargs):
        raise AssertionError("the kubernetes package's ApiClient was built")
    monkeypatch.setattr(api_client.ApiClient, "__init__", refuse)
    path = tmp_path / "config"
    path.write_text("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://k:6443'}}]\n"
                    "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
                    "current-context: c\n")
    config = KubeConfig.from_file(str(path))
    assert config.current.server == "https://k:6443" and config.current.authorization == "Bearer t"
    assert config.reload().server == "https://k:6443"  # a reload loads the same way

