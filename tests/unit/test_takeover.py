"""What the runtime does when this replica takes the Lease over: every service is reconciled again
beside the fleet loop's first pass, a few at a time and the most recently changed first; the
cluster audits wait for that pass, not for ever; kopf hands over a large listing quickly."""
from __future__ import annotations

import asyncio
import time

import kopf
import pytest

from gpufleet.fleet import cluster_audit
from gpufleet.fleet.cluster_audit import ClusterAuditor
from gpufleet.metrics import OperatorMetrics
from gpufleet.settings import LeaderElection, OperatorSettings
from gpufleet.wiring import handlers
from gpufleet.wiring.runtime import TAKEOVER_RECONCILE_CONCURRENCY, OperatorRuntime, reconcile_order
from gpufleet_kit.kube.config import KubeConfig
from tests.unit.test_settings import KUBECONFIG


@pytest.fixture
def kubeconfig(tmp_path):
    path = tmp_path / "config"
    path.write_text(KUBECONFIG)
    return path


def test_the_most_recently_changed_come_first_and_those_never_seen_changing_last_by_name():
    keys = [("ml", "a"), ("ml", "b"), ("ml", "c"), ("ops", "a")]
    assert reconcile_order(keys, {("ml", "c"): 5.0, ("ops", "a"): 9.0}) == [
        ("ops", "a"), ("ml", "c"), ("ml", "a"), ("ml", "b")]


@pytest.fixture
async def candidate(kubeconfig):
    """A replica under leader election that knows twelve services; its clients closed after."""
    rt = OperatorRuntime(KubeConfig.from_file(str(kubeconfig)),
                         OperatorSettings(leader_election=LeaderElection(identity="pod-0")))
    rt.known.update(("ml", f"s{i}") for i in range(12))
    yield rt
    await rt.kube.close()
    assert rt.elector is not None
    await rt.elector.kube.close()


async def test_a_new_leader_reconciles_every_service_a_few_at_a_time_the_most_recently_changed_first(
        candidate, monkeypatch):
    rt = candidate
    keys = sorted(rt.known)
    rt.changed_at.update({("ml", "s3"): 50.0, ("ml", "s7"): 60.0})
    rt.trigger("ml", "s5", apply=False)  # a watch event while following: the most recent change
    running, peak, order = 0, 0, []

    async def reconcile_key(ns, name, apply_children=True):
        nonlocal running, peak
        assert apply_children
        order.append(name)
        running += 1
        peak = max(peak, running)
        if name == "s5":  # meanwhile a watch event's reconcile handles s9
            rt.controller.last_reconciled[("ml", "s9")] = time.monotonic()
        await asyncio.sleep(0.01)
        running -= 1
        rt.controller.last_reconciled[(ns, name)] = time.monotonic()
    monkeypatch.setattr(rt.controller, "reconcile_key", reconcile_key)

    await rt._leadership_changed(True)
    assert rt.drain_triggered() == {}  # the reconciles asked for while following are the takeover's
    assert rt.fleet is not None and not rt.fleet.first_pass.is_set()  # the fleet loop's first pass is due
    assert rt._takeover is not None
    await rt._takeover
    assert order[:3] == ["s5", "s7", "s3"]
    assert sorted(order) == sorted(k[1] for k in keys if k[1] != "s9")
    assert peak == TAKEOVER_RECONCILE_CONCURRENCY == 4


async def test_a_resync_pass_during_the_takeover_does_not_make_it_skip_the_services_not_reached_yet(
        candidate, monkeypatch):
    rt, done = candidate, []

    async def reconcile_key(ns, name, apply_children=True):
        if not done:  # the resync's pass comes while the takeover is at its first services
            assert not any(rt.resync_due(*key, time.monotonic()) for key in sorted(rt.known))
        await asyncio.sleep(0)
        done.append(name)
        rt.controller.last_reconciled[(ns, name)] = time.monotonic()
    monkeypatch.setattr(rt.controller, "reconcile_key", reconcile_key)

    await rt._leadership_changed(True)
    assert rt._takeover is not None
    await rt._takeover
    assert sorted(done) == sorted(name for _, name in rt.known)
    # Met by the resync and reconciled since: due resync_seconds after the reconcile, as before.
    now = time.monotonic()
    assert not rt.resync_due("ml", "s0", now) and rt.resync_due("ml", "s0", now + rt.settings.resync_seconds)


async def test_losing_the_lease_stops_the_takeovers_reconciles(candidate, monkeypatch):
    rt = candidate
    rt.known.update(("ml", f"s{i}") for i in range(20))
    done: list[str] = []

    async def reconcile_key(ns, name, apply_children=True):
        await asyncio.sleep(0.05)
        done.append(name)
    monkeypatch.setattr(rt.controller, "reconcile_key", reconcile_key)
    await rt._leadership_changed(True)
    task = rt._takeover
    await asyncio.sleep(0.02)
    await rt._leadership_changed(False)
    await asyncio.gather(task, return_exceptions=True)
    assert task is not None and task.cancelled() and done == []


class Lead:
    def __init__(self):
        self.leading = False
        self._event = asyncio.Event()

    def acting(self) -> bool:
        return self.leading

    async def wait_leading(self) -> None:
        await self._event.wait()

    def lead(self) -> None:
        self.leading = True
        self._event.set()


@pytest.mark.parametrize("first_pass_after", [None, 0.1])
async def test_a_new_leaders_first_cluster_audit_waits_for_the_first_pass_but_not_for_ever(
        monkeypatch, first_pass_after):
    # Without a first pass the audit waits AUDITS_WAIT_S and no less; with one it goes right after
    # it, long before AUDITS_WAIT_S (no upper bound that a slow machine could miss).
    wait = 0.3 if first_pass_after is None else 60.0
    monkeypatch.setattr(cluster_audit, "AUDITS_WAIT_S", wait)
    loop = asyncio.get_running_loop()
    lead, first_pass = Lead(), asyncio.Event()
    auditor = ClusterAuditor(objects=None, events=None, status=None, metrics=OperatorMetrics(),
                             watched=set(), leadership=lead, interval=3600, first_pass=first_pass.wait)
    audited: list[float] = []
    passed: list[float] = []

    async def run_once():
        audited.append(loop.time())
        return {}
    monkeypatch.setattr(auditor, "run_once", run_once)

    def pass_done() -> None:
        passed.append(loop.time())
        first_pass.set()
    task = asyncio.create_task(auditor.run_forever())
    try:
        await asyncio.sleep(0.05)
        assert audited == []
        lead.lead()
        took_over = loop.time()
        if first_pass_after is not None:
            loop.call_later(first_pass_after, pass_done)
        while not audited and loop.time() - took_over < 30:
            await asyncio.sleep(0.01)
        assert audited, "no audit"
        if first_pass_after is None:
            assert audited[0] - took_over >= wait - 0.02
        else:
            assert passed and passed[0] <= audited[0] < took_over + wait
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_kopf_hands_a_large_listing_over_at_200_objects_a_second():
    class Runtime:
        settings = OperatorSettings()
        started = False

        async def start(self):
            self.started = True

    settings, rt = kopf.OperatorSettings(), Runtime()
    await handlers.configure(settings=settings, memo=kopf.Memo(runtime=rt))
    queueing = handlers.kopf_queueing(settings)
    assert queueing.worker_limit / queueing.idle_timeout == 200  # 100 workers, each freed 0.5 s after its last event
    assert rt.started
