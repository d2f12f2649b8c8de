"""Kubeconfig and in-cluster loading through the kubernetes package: what a
user's kubeconfig from a cloud provider, a merged $KUBECONFIG list or a pod
gives the operator, and the errors it gets when something is missing."""
from __future__ import annotations

import base64
import datetime
import json
import os
import ssl
from pathlib import Path

import pytest
import yaml

from gpufleet_kit.kube import config as kc
from gpufleet_kit.kube.config import KubeConfig, KubeConfigError
from tests.support.kubeconfigs import exec_plugin, exec_user, plugin_runs, write_kubeconfig


def test_exec_plugin_token_with_expiry(tmp_path):
    cfg = KubeConfig.from_file(write_kubeconfig(tmp_path / "config", user=exec_user(exec_plugin(tmp_path))))
    creds = cfg.current
    assert creds.authorization == "Bearer token-1"
    assert (creds.scheme, creds.token) == ("Bearer", "token-1")
    left = creds.expires_at - datetime.datetime.now(datetime.timezone.utc)
    assert datetime.timedelta(minutes=59) < left <= datetime.timedelta(hours=1)
    assert creds.renew_at == creds.expires_at - kc.EXPIRY_MARGIN
    assert not creds.stale()
    assert creds.stale(now=creds.loaded_at + left.total_seconds())


def test_reload_runs_the_plugin_again_once_per_generation(tmp_path):
    cfg = KubeConfig.from_file(write_kubeconfig(tmp_path / "config", user=exec_user(exec_plugin(tmp_path))))
    first = cfg.current
    second = cfg.reload(unless_newer_than=first.generation)
    assert second.token == "token-2" and second.generation == first.generation + 1
    # A second caller that saw the same (refused) generation gets the new credentials, no new run.
    assert cfg.reload(unless_newer_than=first.generation) is second
    assert plugin_runs(tmp_path) == 2


def test_stale_exec_token_is_refreshed(tmp_path, monkeypatch):
    # A plugin whose tokens are about to expire: stale as soon as loaded (once the floor allows).
    monkeypatch.setattr(kc, "MIN_RELOAD_SECONDS", 0.0)
    cfg = KubeConfig.from_file(write_kubeconfig(tmp_path / "config",
                                                user=exec_user(exec_plugin(tmp_path, expires_in=5))))
    assert cfg.current.stale()
    assert cfg.refresh_if_stale().token == "token-2"


def test_short_lived_tokens_are_not_reloaded_on_every_request(tmp_path):
    cfg = KubeConfig.from_file(write_kubeconfig(tmp_path / "config",
                                                user=exec_user(exec_plugin(tmp_path, expires_in=1))))
    creds = cfg.current
    assert not creds.stale()
    assert creds.reload_at == pytest.approx(creds.loaded_at + kc.MIN_RELOAD_SECONDS, abs=0.5)


def test_exec_token_without_expiry_is_kept_until_refused(tmp_path):
    cfg = KubeConfig.from_file(write_kubeconfig(tmp_path / "config",
                                                user=exec_user(exec_plugin(tmp_path, expires_in=None))))
    assert cfg.current.expires_at is None and cfg.current.reload_at is None


def test_refused_credentials_are_reloaded_unless_just_loaded(tmp_path, monkeypatch):
    cfg = KubeConfig.from_file(write_kubeconfig(tmp_path / "config", user=exec_user(exec_plugin(tmp_path))))
    refused = cfg.current
    assert cfg.reload_refused(refused) is None  # loaded moments ago: a new token would not help
    monkeypatch.setattr(kc, "MIN_RELOAD_SECONDS", 0.0)
    assert cfg.reload_refused(refused).token == "token-2"
    assert cfg.reload_refused(refused).token == "token-2"  # already replaced: no third run
    assert plugin_runs(tmp_path) == 2


def test_failing_plugin_names_the_file_user_and_error(tmp_path):
    path = write_kubeconfig(tmp_path / "config", user=exec_user(
        exec_plugin(tmp_path, exit_code=3, stderr="error: SSO session expired; run aws sso login")))
    with pytest.raises(KubeConfigError) as e:
        KubeConfig.from_file(path)
    msg = str(e.value)
    assert str(path) in msg and "user 'dev'" in msg
    assert "exec: process returned 3" in msg and "SSO session expired" in msg


def test_missing_plugin_command(tmp_path):
    path = write_kubeconfig(tmp_path / "config", user=exec_user(tmp_path / "no-such-plugin"))
    with pytest.raises(KubeConfigError, match=rf"kubeconfig {path}: user 'dev': the credential plugin failed"):
        KubeConfig.from_file(path)


def test_merged_kubeconfig_list(tmp_path, monkeypatch):
    # Cluster and context in one file, the user's credentials in another (as `aws eks update-kubeconfig`
    # or a separate credentials file leave them); the first file to name an entry wins.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    clusters = tmp_path / "a" / "clusters"
    clusters.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "prod",
        "clusters": [{"name": "prod", "cluster": {"server": "https://prod.example:6443",
                                                  "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "prod", "context": {"cluster": "prod", "user": "oncall", "namespace": "serving"}}],
        "users": [{"name": "oncall", "user": {"token": "from-a"}}],
    }))
    (tmp_path / "b" / "token").write_text("from-b-file\n")
    creds_file = tmp_path / "b" / "credentials"
    creds_file.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "other",
        "clusters": [{"name": "other", "cluster": {"server": "https://other.example"}}],
        "contexts": [{"name": "other", "context": {"cluster": "other", "user": "other"}}],
        "users": [{"name": "oncall", "user": {"token": "ignored"}},
                  {"name": "other", "user": {"tokenFile": "token"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", f"{clusters}{os.pathsep}{creds_file}")
    cfg = KubeConfig.auto()
    assert (cfg.server, cfg.current.token, cfg.namespace, cfg.insecure) == \
        ("https://prod.example:6443", "from-a", "serving", True)
    # The other file's context, with its token file found next to that file.
    other = KubeConfig.auto(context="other")
    assert (other.server, other.current.token) == ("https://other.example", "from-b-file")


def test_explicit_path_list_and_missing_entries(tmp_path):
    real = write_kubeconfig(tmp_path / "config", user={"token": "t"})
    cfg = KubeConfig.auto(f"{tmp_path / 'absent'}{os.pathsep}{real}")
    assert cfg.current.token == "t"
    assert "absent" in cfg.source  # the description names every file it was asked to read


def test_token_file_is_reread(tmp_path):
    (tmp_path / "token").write_text("first\n")
    cfg = KubeConfig.from_file(write_kubeconfig(tmp_path / "config", user={"tokenFile": "token"}))
    assert cfg.current.token == "first"
    assert cfg.current.reload_at == pytest.approx(cfg.current.loaded_at + kc.TOKEN_FILE_REREAD_SECONDS)
    (tmp_path / "token").write_text("rotated\n")
    assert cfg.reload().token == "rotated"


def test_inline_certificates_and_namespace(tmp_path, pki):
    b64 = lambda name: base64.b64encode((pki / name).read_bytes()).decode()  # noqa: E731
    cfg = KubeConfig.from_file(write_kubeconfig(
        tmp_path / "config", server="https://127.0.0.1:6443", namespace="team-a",
        cluster={"certificate-authority-data": b64("ca.crt")},
        user={"client-certificate-data": b64("admin.crt"), "client-key-data": b64("admin.key")}))
    creds = cfg.current
    assert Path(creds.ca_file).read_bytes() == (pki / "ca.crt").read_bytes()
    assert Path(creds.cert_file).read_bytes() == (pki / "admin.crt").read_bytes()
    assert Path(creds.key_file).read_bytes() == (pki / "admin.key").read_bytes()
    assert creds.authorization is None and creds.namespace == "team-a"
    assert isinstance(creds.ssl_context(), ssl.SSLContext)  # the client certificate loads


def test_relative_certificate_paths_resolve_against_the_kubeconfig(tmp_path, pki):
    cfg = KubeConfig.from_file(write_kubeconfig(
        pki / "config", server="https://127.0.0.1:6443", cluster={"certificate-authority": "ca.crt"},
        user={"client-certificate": "admin.crt", "client-key": "admin.key"}))
    assert cfg.ca_file == str(pki / "ca.crt") and cfg.cert_file == str(pki / "admin.crt")


@pytest.fixture
def pod(tmp_path) -> tuple[dict, Path]:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text("pod-token")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (sa / "namespace").write_text("gpufleet-system")
    return {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}, sa


def test_in_cluster_service_account(pod):
    env, sa = pod
    cfg = KubeConfig.in_cluster(env, sa)
    creds = cfg.current
    assert (creds.server, creds.ca_file, creds.authorization, creds.namespace) == \
        ("https://10.96.0.1:443", str(sa / "ca.crt"), "Bearer pod-token", "gpufleet-system")
    assert creds.reload_at == pytest.approx(creds.loaded_at + kc.TOKEN_FILE_REREAD_SECONDS)
    (sa / "token").write_text("rotated")  # the kubelet rotates projected tokens in place
    assert cfg.reload().token == "rotated"


def test_in_cluster_needs_the_service_host(pod):
    _env, sa = pod
    with pytest.raises(KubeConfigError, match="not running inside a Kubernetes pod"):
        KubeConfig.in_cluster({}, sa)


def test_auto_prefers_kubeconfig_env_then_in_cluster(tmp_path, monkeypatch, pod):
    env, sa = pod
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setattr(kc, "IN_CLUSTER_DIR", sa)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert KubeConfig.auto().source.startswith("in-cluster")
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "config", user={"token": "t"})))
    assert KubeConfig.auto().server == "http://127.0.0.1:6443"


def test_missing_file(tmp_path):
    with pytest.raises(KubeConfigError, match=rf"kubeconfig {tmp_path}/nope does not exist"):
        KubeConfig.from_file(tmp_path / "nope")


def test_unknown_context_names_the_file_and_context(tmp_path):
    path = write_kubeconfig(tmp_path / "config")
    with pytest.raises(KubeConfigError) as e:
        KubeConfig.from_file(path, context="staging")
    assert str(path) in str(e.value) and "staging" in str(e.value)


def test_context_without_cluster_entry(tmp_path):
    path = tmp_path / "config"
    path.write_text(json.dumps({"current-context": "dev", "contexts": [{"name": "dev", "context": {
        "cluster": "gone", "user": "u"}}], "clusters": [], "users": []}))
    with pytest.raises(KubeConfigError, match=rf"kubeconfig {path}: .*gone"):
        KubeConfig.from_file(path)
