"""The dev operator's guard token is minted from plain code and from inside a running event loop (the
e2e tests start operators from async fixtures, where asyncio.run alone cannot run)."""
from __future__ import annotations

import asyncio

from gpufleet_dev.devcluster import guard_token


def _fake_request(seen: list):
    async def request(config, namespace, service_account, expiration_seconds):
        seen.append((namespace, service_account, expiration_seconds))
        return "a-token"
    return request


def _kubeconfig(tmp_path):
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\ncurrent-context: dev\nclusters: [{name: dev, cluster: "
                    "{server: 'http://127.0.0.1:1'}}]\ncontexts: [{name: dev, context: {cluster: dev, user: dev}}]\n"
                    "users: [{name: dev, user: {}}]\n")
    return str(path)


def test_minted_outside_a_loop(tmp_path, monkeypatch):
    seen: list = []
    monkeypatch.setattr(guard_token, "_request", _fake_request(seen))
    out = guard_token.mint(_kubeconfig(tmp_path), tmp_path / "token")
    assert out.read_text() == "a-token" and oct(out.stat().st_mode)[-3:] == "600"
    assert seen == [(guard_token.NAMESPACE, guard_token.SERVICE_ACCOUNT, guard_token.EXPIRATION_SECONDS)]


async def test_minted_from_inside_a_running_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(guard_token, "_request", _fake_request([]))
    assert asyncio.get_running_loop()
    assert guard_token.mint(_kubeconfig(tmp_path), tmp_path / "token").read_text() == "a-token"
