"""What a replica without the lease does: its API client refuses writes before
sending them (reads still go out), its watch events ask for reconciles only
when a spec needs handling, and a failed reconcile is retried as kopf did
(transient errors soon, the rest with backoff), but never for lack of the lease."""
from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpufleet.wiring.handlers import spec_unhandled
from gpufleet.wiring.runtime import retry_delay
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig
from gpufleet_kit.kube.errors import ApiError, NotLeading


@pytest.fixture
async def apiserver(tmp_path):
    seen: list[str] = []

    async def answer(request):
        seen.append(request.method)
        if request.path == "/api/v1":
            return web.json_response({"resources": [{"name": "pods", "kind": "Pod", "namespaced": True}]})
        return web.json_response({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    server = TestServer(app)
    await server.start_server()
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{server.port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    yield KubeConfig.from_file(str(cfg)), seen
    await server.close()


async def test_writes_are_refused_unsent_without_the_lease_and_reads_still_work(apiserver):
    config, seen = apiserver
    left = {"s": 0.0}
    async with KubeClient(config, write_fence=lambda: left["s"]) as kube:
        assert (await kube.get("v1", "Pod", "p", "default"))["metadata"]["name"] == "p"
        with pytest.raises(NotLeading):
            await kube.merge_patch("v1", "Pod", "p", {"metadata": {"labels": {"a": "b"}}}, "default")
        await kube.event({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"}},
                         reason="X", message="y")  # best effort: refused and logged, not raised
        assert "PATCH" not in seen and "POST" not in seen
        left["s"] = 5.0
        await kube.merge_patch("v1", "Pod", "p", {"metadata": {"labels": {"a": "b"}}}, "default")
        assert seen[-1] == "PATCH"


@pytest.mark.parametrize("type_, generation, observed, wanted", [
    (None, 3, 3, True),          # the initial listing: as after a restart
    ("ADDED", 1, None, True),
    ("MODIFIED", 2, 1, True),    # a spec change not handled yet
    ("MODIFIED", 2, 2, False),   # status only (the operator's own writes)
])
def test_watch_events_ask_for_a_reconcile_only_when_a_spec_needs_handling(type_, generation, observed, wanted):
    body = {"metadata": {"generation": generation}, "status": {"observedGeneration": observed}}
    assert spec_unhandled(type_, body) is wanted


@pytest.mark.parametrize("error, failures, delay", [
    (NotLeading("PATCH x"), 1, None),
    (ApiError(409, "Conflict", "x"), 3, 5.0),
    (ApiError(503, "ServiceUnavailable", "x"), 1, 5.0),
    (ApiError(404, "NotFound", "kind X is not served"), 1, 30.0),
    (ApiError(404, "NotFound", "kind X is not served"), 3, 120.0),
    (ApiError(404, "NotFound", "kind X is not served"), 10, 600.0),
    (ApiError(403, "Forbidden", "x", {"details": {"causes": [{"reason": "NamespaceTerminating"}]}}), 1, None),
    (RuntimeError("bug"), 2, 60.0),
])
def test_retry_after_a_failed_reconcile(error, failures, delay):
    assert retry_delay(error, failures) == delay
