"""The router's discovery against the in-memory API server (tests/support/fake_kube.py): with
``watch`` a pod turning Ready, a new service or a deleted pod reaches the routes from the watch
streams alone, without another LIST, and a burst of changes costs a few rebuilds rather than
one per event; ``list`` keeps listing on its interval; the command refuses an unknown mode."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from click.testing import CliRunner

from gpufleet.manifests import names
from gpufleet_api import API_VERSION, KIND
from gpufleet_router import discovery
from gpufleet_router.cli import router as router_command
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.server import Fleet, RouterSettings, serve
from tests.support.fake_kube import FakeKube
from tests.support.kubeconfigs import write_kubeconfig
from tests.support.waiting import wait_for
from tests.unit.router.test_drain import free_port, wait_ready

# A pod that becomes Ready is routable this soon (the watch event, then the rebuild); a listing
# router would need its whole interval (60 s below).
ROUTABLE_SECONDS = 5.0


def isvc(name: str) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": "ml"},
            "spec": {"model": {"name": f"org/{name}"}, "engine": {"kvCache": {"blockSize": 16}}}}


def engine_pod(service: str, name: str, ip: str, ready: bool = False) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "labels": names.selector_labels(service)},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def ready_patch(ready: bool = True) -> dict:
    return {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def serving(fleet: Fleet, model: str) -> list[str]:
    picker = fleet.picker(model)
    return sorted(r.pod for r in picker.eligible()) if picker else []


class Running:
    def __init__(self, kube: FakeKube, mode: str = discovery.Discovery.WATCH, interval: float = 60.0):
        self.kube = kube
        self.fleet = Fleet(RouterSettings(discovery=mode, discovery_interval=interval), RouterMetrics())

    async def __aenter__(self) -> "Running":
        self.task = asyncio.create_task(discovery.run(self.fleet, self.kube))
        await asyncio.wait_for(self.fleet.listed.wait(), 5)
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.fixture
def kube() -> FakeKube:
    k = FakeKube()
    k.put(isvc("tiny"))
    k.put(engine_pod("tiny", "tiny-0", "10.0.0.1", ready=True))
    k.put(engine_pod("tiny", "tiny-1", "10.0.0.2"))
    k.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unrelated", "namespace": "ml"},
           "status": {"podIP": "10.0.0.9", "conditions": [{"type": "Ready", "status": "True"}]}})
    return k


async def test_a_pod_turning_ready_is_routable_from_the_watch_without_another_list(kube):
    async with Running(kube) as r:
        assert serving(r.fleet, "org/tiny") == ["tiny-0"]
        lists = {k: n for k, n in kube.calls.items() if k[0] == "list"}
        assert lists == {("list", KIND): 1, ("list", "Pod"): 1, ("list", "InferenceAdapter"): 1,
                         ("list", "InferenceTenants"): 1, ("list", "Secret"): 1}

        await kube.merge_patch("v1", "Pod", "tiny-1", ready_patch(), "ml", subresource="status")
        await wait_for(lambda: serving(r.fleet, "org/tiny") == ["tiny-0", "tiny-1"], timeout=ROUTABLE_SECONDS,
                       interval=0.01, what="tiny-1 routable after turning Ready")

        await kube.delete("v1", "Pod", "tiny-0", "ml")
        kube.put(isvc("other"))
        kube.put(engine_pod("other", "other-0", "10.0.0.3", ready=True))
        await wait_for(lambda: serving(r.fleet, "org/other") == ["other-0"] and
                       serving(r.fleet, "org/tiny") == ["tiny-1"], timeout=ROUTABLE_SECONDS, interval=0.01,
                       what="the new service routed and the deleted pod gone")
        assert {k: n for k, n in kube.calls.items() if k[0] == "list"} == lists   # no LIST since the first
        assert kube.calls["watch", "Pod"] == 1


async def test_a_burst_of_changes_is_rebuilt_a_few_times_not_once_per_event(kube):
    async with Running(kube) as r:
        updates = 0   # the routes published: one per rebuild
        update = r.fleet.update

        def counted(*args, **kwargs):
            nonlocal updates
            updates += 1
            update(*args, **kwargs)
        r.fleet.update = counted   # type: ignore[method-assign]
        for i in range(40):   # 40 changes over about 0.4 s
            await kube.merge_patch("v1", "Pod", "tiny-1", ready_patch(i % 2 == 0), "ml", subresource="status")
            await asyncio.sleep(0.01)
        await wait_for(lambda: serving(r.fleet, "org/tiny") == ["tiny-0"], timeout=ROUTABLE_SECONDS, interval=0.01,
                       what="the last change (tiny-1 not ready) in the routes")
        # At most one rebuild per 100 ms (plus the one at once after the first change), however slow the
        # machine: 40 events would be 40 rebuilds without coalescing.
        assert 1 <= updates <= 12, updates


async def test_the_rebuild_waits_out_the_coalescing_window_after_the_last():
    kube = FakeKube()
    kube.put(isvc("tiny"))
    kube.put(engine_pod("tiny", "tiny-0", "10.0.0.1"))
    fleet = Fleet(RouterSettings(), RouterMetrics())
    clock = {"now": 100.0}
    watcher = discovery.Watcher(fleet, kube, coalesce=0.3, clock=lambda: clock["now"])
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.wait_for(fleet.listed.wait(), 5)
        assert watcher.builds == 1
        await kube.merge_patch("v1", "Pod", "tiny-0", ready_patch(), "ml", subresource="status")
        # The clock says the last build was just now: the change waits (about 0.3 s) for the window.
        await asyncio.sleep(0.1)
        assert watcher.builds == 1 and serving(fleet, "org/tiny") == []
        await wait_for(lambda: watcher.builds == 2, timeout=ROUTABLE_SECONDS, interval=0.01, what="the rebuild")
        assert serving(fleet, "org/tiny") == ["tiny-0"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_list_mode_lists_on_its_interval_and_never_watches(kube):
    async with Running(kube, discovery.Discovery.LIST, interval=0.05) as r:
        await wait_for(lambda: kube.calls["list", "Pod"] >= 3, timeout=5, interval=0.01, what="three listings")
        await kube.merge_patch("v1", "Pod", "tiny-1", ready_patch(), "ml", subresource="status")
        await wait_for(lambda: serving(r.fleet, "org/tiny") == ["tiny-0", "tiny-1"], timeout=5, interval=0.01,
                       what="tiny-1 listed Ready")
    assert not [k for k in kube.calls if k[0] == "watch"]


async def test_a_watching_router_serves_a_service_created_after_it_started(kube):
    settings = RouterSettings(drain_grace=0.0, drain_timeout=1.0)
    assert settings.discovery == discovery.Discovery.WATCH   # the default
    stop, port = asyncio.Event(), free_port()
    task = asyncio.create_task(serve(kube, settings, "127.0.0.1", port, stop))
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(url)
        kube.put(isvc("later"))

        async def models() -> set[str]:
            async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as resp:
                return {m["id"] for m in (await resp.json())["data"]}
        async def listed() -> bool:
            return await models() == {"org/tiny", "org/later"}
        await wait_for(listed, timeout=ROUTABLE_SECONDS, interval=0.02, what="/v1/models listing it")
        assert kube.calls["list", KIND] == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def test_the_command_takes_watch_or_list_and_refuses_anything_else(tmp_path, monkeypatch):
    from gpufleet_router import server
    seen: list[RouterSettings] = []

    async def fake_serve(kube, settings, host, port, stop):
        seen.append(settings)
    monkeypatch.setattr(server, "serve", fake_serve)
    config = str(write_kubeconfig(tmp_path / "config", user={"token": "t"}))
    runner = CliRunner()
    assert runner.invoke(router_command, ["--kubeconfig", config]).exit_code == 0
    assert runner.invoke(router_command, ["--kubeconfig", config, "--discovery", "list"]).exit_code == 0
    assert [s.discovery for s in seen] == ["watch", "list"]
    bad = runner.invoke(router_command, ["--kubeconfig", config, "--discovery", "poll"])
    assert bad.exit_code == 2
    assert "Invalid value for '--discovery': 'poll' is not one of 'watch', 'list'" in bad.output
    assert "--discovery [watch|list]" in runner.invoke(router_command, ["--help"]).output
