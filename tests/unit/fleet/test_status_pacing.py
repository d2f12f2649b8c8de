"""A busy service's loop against an in-memory API server under a fake clock: its figures move on
every one-second tick, and still reach status at most once per --status-figures-interval-seconds;
a condition change or a figure rising above its limit is written at once, with the figures."""
import copy

import pytest

from gpufleet.fleet.canary import SLI_WRITE_S
from gpufleet.fleet.ports import ServicePorts
from gpufleet.fleet.service_loop import ServiceLoop
from gpufleet.metrics import OperatorMetrics
from gpufleet.reconcile import conditions as c
from gpufleet.reconcile.figures import TIME_FIELD
from gpufleet.wiring.controller import Controller
from tests.support.fake_kube import FakeKube
from tests.unit.fleet.test_service_loop import FakeReader, deployment, isvc, pod

PODS = [pod("a"), pod("b")]
# No decision can follow (min = max), so every write the tick makes is the figures' or a condition's.
PINNED = {"minReplicas": 2, "maxReplicas": 2}


def busy_service(kube: FakeKube, figures_interval: float) -> tuple[ServiceLoop, FakeReader, dict]:
    kube.put(isvc(desired=2, ready=2, autoscaling=PINNED))
    kube.put(deployment(2, 2))
    reader = FakeReader({"a": 0.4, "b": 0.4})
    metrics = OperatorMetrics()
    controller = Controller(kube, metrics)
    ports = ServicePorts(events=kube, status=controller, locks=controller, objects=kube, replicas=reader,
                         metrics=metrics)
    # The fleet loop's copy, kept current by the status writes (and the watch, which this test has not).
    body = copy.deepcopy(kube.obj("InferenceService", "chat"))
    return ServiceLoop(ports, "ml", "chat", figures_interval=figures_interval), reader, body


def status_writes(kube: FakeKube) -> list[dict]:
    return [b["status"] for verb, key, b in kube.writes if verb == "patch/status" and key[0] == "InferenceService"]


def figure_writes(kube: FakeKube) -> list[dict]:
    """The status writes that carried the KV figure (the fragmentation audit's own write aside)."""
    return [w for w in status_writes(kube) if "kvCacheUsagePercent" in w]


def status(kube: FakeKube) -> dict:
    return kube.obj("InferenceService", "chat")["status"]


@pytest.mark.parametrize("interval, most, fewest", [(20, 7, 6), (0, 120, 120)])
async def test_figures_moving_every_tick_reach_status_at_most_once_per_interval(interval, most, fewest):
    kube = FakeKube()
    loop, reader, body = busy_service(kube, interval)
    for second in range(120):
        kv = 0.40 + 0.01 * (second % 20)  # a new KV% on every tick, between the watermarks
        reader.kv = {"a": kv, "b": kv}
        await loop.tick(body, PODS, now=1000.0 + second)
    writes = figure_writes(kube)
    assert fewest <= len(writes) <= most, f"{len(writes)} figure writes in 120 ticks at interval {interval}"
    # (figuresUpdateTime has whole seconds: writes within one second of the test's wall clock leave it as it is)
    assert all(set(w) <= {"kvCacheUsagePercent", TIME_FIELD} for w in writes) and TIME_FIELD in writes[0]
    assert loop.figures.written_at > 1119 - max(interval, 1)   # and they are never older than the interval


async def test_a_condition_change_is_written_at_once_with_the_current_figures():
    kube = FakeKube()
    loop, reader, body = busy_service(kube, 20)
    await loop.tick(body, PODS, now=1000.0)
    assert status(kube)["kvCacheUsagePercent"] == 40
    reader.kv = {"a": 0.55, "b": None}   # b stops answering; a's KV moved
    await loop.tick(body, PODS, now=1001.0)
    st = status(kube)
    scaling = c.get(st["conditions"], c.SCALING) or {}
    assert (scaling.get("status"), scaling.get("reason")) == ("False", "MetricsUnavailable")
    assert st["kvCacheUsagePercent"] == 55 and "conditions" in figure_writes(kube)[-1] and st[TIME_FIELD]
    writes = len(status_writes(kube))
    reader.kv = {"a": 0.57, "b": None}   # the condition holds: the figure waits for the interval
    await loop.tick(body, PODS, now=1002.0)
    assert len(status_writes(kube)) == writes and status(kube)["kvCacheUsagePercent"] == 55
    await loop.tick(body, PODS, now=1021.0)
    assert status(kube)["kvCacheUsagePercent"] == 57


async def test_kv_rising_above_the_high_watermark_is_written_at_once_and_falling_back_waits():
    kube = FakeKube()
    loop, reader, body = busy_service(kube, 20)
    await loop.tick(body, PODS, now=1000.0)
    reader.kv = {"a": 0.95, "b": 0.95}
    await loop.tick(body, PODS, now=1001.0)
    assert status(kube)["kvCacheUsagePercent"] == 95
    reader.kv = {"a": 0.5, "b": 0.5}
    await loop.tick(body, PODS, now=1002.0)
    assert status(kube)["kvCacheUsagePercent"] == 95
    await loop.tick(body, PODS, now=1021.0)
    assert status(kube)["kvCacheUsagePercent"] == 50


async def test_a_scaling_decision_carries_the_figures_and_starts_the_interval_again():
    kube = FakeKube()
    kube.put(isvc(desired=2, ready=2))
    kube.put(deployment(2, 2))
    reader = FakeReader({"a": 0.5, "b": 0.5})
    metrics = OperatorMetrics()
    controller = Controller(kube, metrics)
    ports = ServicePorts(events=kube, status=controller, locks=controller, objects=kube, replicas=reader,
                         metrics=metrics)
    loop = ServiceLoop(ports, "ml", "chat", figures_interval=20)
    body = copy.deepcopy(kube.obj("InferenceService", "chat"))
    await loop.tick(body, PODS, now=1000.0)
    reader.kv = {"a": 0.95, "b": 0.95}
    await loop.tick(body, PODS, now=1010.0)
    decision = next(w for w in status_writes(kube) if "lastScaling" in w)
    assert decision["desiredReplicas"] == 3 and decision["kvCacheUsagePercent"] == 95
    assert loop.figures.written_at == 1010.0


@pytest.mark.parametrize("interval, sli_seconds", [(30, 30), (20, 20), (0, SLI_WRITE_S)])
def test_the_canary_slis_and_the_adapters_rates_follow_the_same_interval(interval, sli_seconds):
    """status.rollout.sli: at most as often as the figures, never more often than before (every 10 s)."""
    loop, _, _ = busy_service(FakeKube(), interval)
    assert loop.canary.sli_write_seconds == sli_seconds
    assert loop.adapters.status.figures_interval == interval


async def test_a_followers_reads_write_no_figures_and_the_new_leaders_first_pass_does_at_once():
    """Following reads the same figures into the same loop and writes nothing, the figures either;
    its reads do not start the interval, so the first pass as leader writes the current figures."""
    kube = FakeKube()
    loop, reader, body = busy_service(kube, 20)
    for second in range(30):
        kv = 0.40 + 0.01 * (second % 20)
        reader.kv = {"a": kv, "b": kv}
        await loop.follow(body, PODS, now=1000.0 + second)
    assert loop.warm is not None  # it did read
    assert status_writes(kube) == [] and loop.figures.written_at is None
    reader.kv = {"a": 0.6, "b": 0.6}
    await loop.take_over(body, PODS, now=1030.0, max_age=15.0)
    assert status(kube)["kvCacheUsagePercent"] == 60 and status(kube)[TIME_FIELD]
    assert loop.figures.written_at == 1030.0
