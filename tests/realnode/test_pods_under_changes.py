"""Changes under streaming load through the chart's router, with the openai SDK (issue 33's bar): a
canary revision promoted to every replica, a canary rolled back by its SLIs, the engine of a replica
killed with SIGKILL in the middle of streams (the router resumes them on the other replica), and a
scale-in. The kill lands mid-answer by construction: vLLM is stopped (SIGSTOP) first, and killed only
if its guard still has streams in flight that the stopped engine can no longer finish. Every stream is
checked whole (``load.checked_streaming``): one id, its full length of
tokens, finish_reason "length" and a usage that counts every token. A 429 with Retry-After that the
client honours is served, not an error.

The session's tiny service (one replica) is used, so the real node holds at most two engines: stable
and canary, or two stable replicas. The module leaves it at one Ready replica with strategy Rolling.
Its name sorts it after the modules that run services of their own (test_disaggregated, test_lora:
the tiny service, once created, keeps an engine's room on the node) and before test_real_pods: run
after that module, the router never listed the model within 120 s (not yet understood).
"""
from __future__ import annotations

import asyncio

import openai
import pytest

from gpufleet.manifests import names
from gpufleet_dev.devcluster import node
from tests.realnode.load import answered_after, checked_streaming, in_flight_ended, model_listed
from tests.realnode.product import (
    API,
    SERVICE,
    _pods,
    _ready,
    _service_ready,
    _service_settled,
    exec_get,
    metric_sum,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(1500)

ROUTER_SELECTOR = "app.kubernetes.io/name=gpufleet-router"
# Short steps: the test judges the mechanism, not a production hold.
CANARY = {"strategy": "Canary", "steps": [{"weightPercent": 50, "holdSeconds": 10},
                                          {"weightPercent": 100, "holdSeconds": 5}],
          "analysis": {"minRequests": 5}}


@pytest.fixture
async def router(install, kube):
    svc = await kube.get("v1", "Service", "gpufleet-router", install.operator_ns)
    client = openai.AsyncOpenAI(base_url=f"http://{svc['spec']['clusterIP']}/v1", api_key="none", max_retries=0,
                                timeout=120)
    try:
        await wait_for(lambda: model_listed(client), timeout=120, what="the router listing the model")
        yield client
    finally:
        await client.close()


async def _set_spec(kube, ns: str, patch: dict) -> None:
    await kube.merge_patch(API, "InferenceService", SERVICE, {"spec": patch}, ns)


async def _rollout(kube, ns: str) -> dict:
    isvc = await kube.get(API, "InferenceService", SERVICE, ns)
    return (isvc.get("status") or {}).get("rollout") or {}


async def _events(kube, ns: str) -> list[str]:
    return [e.get("reason", "") for e in await kube.list("v1", "Event", ns)
            if e.get("involvedObject", {}).get("name") == SERVICE]


async def _engine_pods(kube, ns: str) -> list[dict]:
    return [p for p in await _pods(kube, ns, names.selector_string(SERVICE)) if not p["metadata"].get(
        "deletionTimestamp")]


def _describe(control_plane, ns: str):
    return lambda: control_plane.kubectl("-n", ns, "get", "pods,deploy", "-o", "wide", check=False).stdout + \
        control_plane.kubectl("-n", ns, "get", "inferenceservice", SERVICE, "-o", "jsonpath={.status.rollout}",
                              check=False).stdout


def _router_metric(kube_pods: list[dict], control_plane, ns: str, name: str, **labels: str) -> float:
    total = 0.0
    for pod in kube_pods:
        container = pod["spec"]["containers"][0]
        text = exec_get(control_plane, ns, pod["metadata"]["name"], container["name"],
                        f"http://127.0.0.1:{container['ports'][0]['containerPort']}/metrics")
        total += metric_sum(text, name, **labels)
    return total


async def _guard_in_flight(control_plane, ns: str, pods: list[dict], metric: str = "gpufleet_guard_in_flight"
                           ) -> list[float]:
    """Each pod's guard's requests in flight to its vLLM (``metric``: or those of them whose first token
    has gone out, ``gpufleet_guard_in_flight_answering``), read off the event loop, together: the clients
    on the loop keep reading meanwhile (a client that stops reading lets vLLM finish its answer into the
    buffers)."""
    texts = await asyncio.gather(*(asyncio.to_thread(exec_get, control_plane, ns, pod["metadata"]["name"], "guard",
                                                     f"http://127.0.0.1:{names.GUARD_PORT}/metrics") for pod in pods))
    return [metric_sum(text, metric) for text in texts]


async def _busiest(kube, control_plane, ns: str, metric: str = "gpufleet_guard_in_flight") -> dict | None:
    """The engine pod whose guard has the most requests in flight now (``metric``), None while none has
    any: the one to kill, so that streams are cut (the router's choice, not the test's, decides where
    they go)."""
    pods = await _engine_pods(kube, ns)
    best, most = None, 0.0
    for pod, in_flight in zip(pods, await _guard_in_flight(control_plane, ns, pods, metric)):
        if in_flight > most:
            best, most = pod, in_flight
    return best


ANSWERING = "gpufleet_guard_in_flight_answering"


def _no_errors(load) -> None:
    assert load.errors == [], f"{len(load.errors)} failed requests (ok {load.ok}, 429 {load.shed}): {load.errors[:5]}"


async def test_a_canary_is_promoted_to_every_replica_under_streaming_load(service, install, kube, control_plane,
                                                                         router):
    ns = install.work_ns
    stable = {p["metadata"]["name"]: p["metadata"]["labels"].get(names.LABEL_REVISION)
              for p in await _engine_pods(kube, ns)}
    async with checked_streaming(router) as load:
        await wait_for(lambda: load.ok > 0, timeout=120, what="a first stream answered through the router")
        # An engine setting: a new revision, started beside the stable one as a canary. The ITL objective
        # is one this 2-core node meets while it runs two CPU engines and the load (2 late gaps in 11 on a
        # busy run rolled a healthy canary back): this test is the promotion; the next one, the rollback.
        await _set_spec(kube, ns, {"rollout": CANARY, "engine": {"maxNumSeqs": 24},
                                   "slo": {"itlP99Milliseconds": 10000}})

        async def canary_serving() -> bool:
            r = await _rollout(kube, ns)
            return bool(r.get("canaryRevision")) and r.get("canaryWeightPercent", 0) > 0 and any(
                _ready(p) and p["metadata"]["labels"].get(names.LABEL_TRACK) == "canary"
                for p in await _engine_pods(kube, ns))
        await wait_for(canary_serving, timeout=600, what="the canary Ready and given a share of the traffic",
                       describe=_describe(control_plane, ns))
        canary = (await _rollout(kube, ns))["canaryRevision"]
        assert canary not in stable.values()
        # The stable pod was left as it was while the canary ran.
        assert set(stable) <= {p["metadata"]["name"] for p in await _engine_pods(kube, ns)}
        await answered_after(load, "the canary took traffic")

        async def promoted() -> bool:
            r = await _rollout(kube, ns)
            pods = await _engine_pods(kube, ns)
            return (r.get("phase") == "Promoted" and not r.get("canaryRevision") and len(pods) == 1
                    and _ready(pods[0]) and pods[0]["metadata"]["labels"].get(names.LABEL_REVISION) == canary
                    and await kube.get_or_none("apps/v1", "Deployment", names.canary_deployment_name(SERVICE),
                                               ns) is None)
        await wait_for(promoted, timeout=900, what="the canary promoted: the stable Deployment on its revision",
                       describe=_describe(control_plane, ns))
        await answered_after(load, "the promotion")
    assert {"CanaryStarted", "CanaryPromoted"} <= set(await _events(kube, ns))
    assert load.ok > 0
    _no_errors(load)


async def test_a_canary_breaching_its_slo_is_rolled_back_under_streaming_load(service, install, kube,
                                                                              control_plane, router):
    ns = install.work_ns
    before = {p["metadata"]["name"] for p in await _engine_pods(kube, ns)}
    async with checked_streaming(router) as load:
        await wait_for(lambda: load.ok > 0, timeout=120, what="a first stream answered through the router")
        # The breach the test injects: a new revision together with a TTFT objective no answer meets, so
        # every stream the canary serves is a bad TTFT event. The stable revision is not analysed.
        # A long first step: the canary is judged there, long before it could be promoted.
        # (ttftControl Off: the guard must not shed what would start late; this test wants it served late.)
        await _set_spec(kube, ns, {"engine": {"maxNumSeqs": 20}, "slo": {"ttftP99Milliseconds": 1},
                                   "admission": {"ttftControl": "Off"},
                                   "rollout": {**CANARY, "steps": [{"weightPercent": 50, "holdSeconds": 600},
                                                                   {"weightPercent": 100, "holdSeconds": 10}]}})

        async def rolled_back() -> bool:
            r = await _rollout(kube, ns)
            return r.get("phase") == "RolledBack" and not r.get("canaryWeightPercent") and "ttft" in r.get(
                "message", "")
        await wait_for(rolled_back, timeout=900, what="the canary rolled back by its TTFT SLI",
                       describe=_describe(control_plane, ns))
        await wait_for(lambda: _service_ready(kube, ns, 1), timeout=300, what="the canary pod gone")
        await answered_after(load, "the rollback")
    # The stable replica served throughout, untouched.
    assert {p["metadata"]["name"] for p in await _engine_pods(kube, ns)} == before
    assert "CanaryRolledBack" in set(await _events(kube, ns))
    _no_errors(load)
    # Back to the stable revision's spec: nothing to roll out.
    await _set_spec(kube, ns, {"engine": {"maxNumSeqs": 24}, "slo": {"ttftP99Milliseconds": 2000},
                               "admission": {"ttftControl": "Objective"}})


def _signal(container_id: str, signal: str) -> None:
    """Signal a container's main process (vLLM's API server, which writes the answers to the guard)."""
    node.ctr("tasks", "kill", "-s", signal, container_id, check=True, capture_output=True)


async def kill_mid_answer(kube, control_plane, ns: str, load, kills: list) -> None:
    """SIGKILL the vLLM of a replica while its guard holds a stream that has begun to answer and that
    vLLM can no longer finish, whatever the machine's speed: the replica with the most answers under
    way has its vLLM stopped (SIGSTOP: it writes nothing more), then its guard is read; an answer vLLM
    wrote whole before the stop drains meanwhile (the guard, the router and the client keep reading), so
    the answers still in flight are unfinished, and the kill cuts them mid-answer: the router has relayed
    their first tokens, so it must resume them (a stream not yet answered would be retried elsewhere and
    prove nothing). When none is (a quiet moment), vLLM goes on (SIGCONT) and another moment is tried.
    Back when every stream in flight at the kill has ended (the router counts a resumed stream before
    its end goes out) and the killed engine restarted and is Ready. ``kills``: (pod, answers cut at the
    kill, stops it took) added."""
    stops = 0
    while stops < 10:
        stops += 1
        victim = await wait_for(lambda: _busiest(kube, control_plane, ns, ANSWERING), timeout=60,
                                what="a replica with answers under way", describe=load.describe)
        vllm = next(c for c in victim["status"]["containerStatuses"] if c["name"] == "vllm")
        restarts, container_id = vllm["restartCount"], vllm["containerID"].split("://", 1)[1]
        _signal(container_id, "SIGSTOP")
        try:
            (held,) = await _guard_in_flight(control_plane, ns, [victim], ANSWERING)
        except BaseException:
            _signal(container_id, "SIGCONT")
            raise
        if held:
            break
        _signal(container_id, "SIGCONT")
    else:
        raise AssertionError(f"no replica's guard held an answer under way while its vLLM was stopped, in 10 "
                             f"tries; {load.describe()}")
    kills.append((victim["metadata"]["name"], held, stops))
    _signal(container_id, "SIGKILL")

    async def victim_back() -> bool:
        pod = await kube.get_or_none("v1", "Pod", victim["metadata"]["name"], ns)
        if pod is None or not _ready(pod):
            return False
        c = next(c for c in pod["status"]["containerStatuses"] if c["name"] == "vllm")
        return c["restartCount"] > restarts
    await in_flight_ended(load, "the kill")
    await answered_after(load, "the engine was killed", clients=4)
    await wait_for(victim_back, timeout=420, what="the killed engine restarted and Ready",
                   describe=_describe(control_plane, ns))


async def test_an_engine_killed_mid_stream_is_resumed_and_a_scale_in_loses_no_stream(service, install, kube,
                                                                                     control_plane, router):
    ns = install.work_ns
    try:
        await killed_and_scaled_in(install, kube, control_plane, router)
    finally:  # the modules after this one change the spec: no canary for them, whatever became of this test.
        # maxReplicas stays 1: the load's TTFT is in the autoscaler's latency window for a while after it
        # ends, and with room for two it rightly scales out, leaving two pods for the next module to count.
        await _set_spec(kube, ns, {"rollout": None, "autoscaling": {"minReplicas": 1, "maxReplicas": 1}})
    # The next module counts the service's pods: the scaled-in one finishes draining first.
    await wait_for(lambda: _service_settled(kube, ns, 1), timeout=300, what="the scaled-in pod gone",
                   describe=_describe(control_plane, ns))


async def killed_and_scaled_in(install, kube, control_plane, router) -> None:
    ns = install.work_ns
    routers = await _pods(kube, install.operator_ns, ROUTER_SELECTOR)
    # Both bounds: a run after this test's own cleanup (maxReplicas 1, `--count`) starts from the same spec.
    await _set_spec(kube, ns, {"autoscaling": {"minReplicas": 2, "maxReplicas": 2}})
    await wait_for(lambda: _service_ready(kube, ns, 2), timeout=720, what="two Ready replicas",
                   describe=_describe(control_plane, ns))
    await wait_for(lambda: model_listed(router), timeout=60, what="the router listing the model")
    resumed_before = _router_metric(routers, control_plane, install.operator_ns,
                                    "gpufleet_router_resumed_streams_total", outcome="resumed")
    # Long answers (600 tokens of 1024): every stream is still running when its engine dies.
    async with checked_streaming(router, clients=4, max_tokens=600) as load:
        await wait_for(lambda: load.ok >= 2, timeout=180, what="streams answered on both replicas")
        # The kill cuts answers under way that its stopped vLLM can no longer finish (kill_mid_answer),
        # and every stream in flight at it has ended before the router's counters are read: they hold
        # what became of each. The router relayed those answers' first tokens, so each must be resumed.
        kills: list = []
        await kill_mid_answer(kube, control_plane, ns, load, kills)
        resumed = await asyncio.to_thread(_router_metric, routers, control_plane, install.operator_ns,
                                          "gpufleet_router_resumed_streams_total", outcome="resumed")
        resumed -= resumed_before
        kills[-1] += (resumed,)
        print(f"\nkill (pod, answers under way its guard held with vLLM stopped, stops it took, streams "
              f"resumed): {kills}")
        before_in = load.ok
        # A scale-in the load does not ask for (four 600-token streams keep two replicas' KV over the
        # watermark, so the autoscaler rightly holds two with minReplicas 1): maxReplicas down to 1.
        await _set_spec(kube, ns, {"autoscaling": {"minReplicas": 1, "maxReplicas": 1}})
        await wait_for(lambda: _service_ready(kube, ns, 1), timeout=300, what="back to one replica",
                       describe=_describe(control_plane, ns))
        await answered_after(load, "the scale-in", clients=4)
    outcomes = {o: _router_metric(routers, control_plane, install.operator_ns, "gpufleet_router_resumed_streams_total",
                                  outcome=o) for o in ("resumed", "refused", "failed")}
    # A router restarted meanwhile (its counters start again at 0) is a failure of its own: it dropped streams.
    restarts = {p["metadata"]["name"]: sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses", []))
                for p in await _pods(kube, install.operator_ns, ROUTER_SELECTOR)}
    # How often the routers' loops woke over 1 s late (no CPU): their connect timeouts fire that late.
    lag = "gpufleet_router_event_loop_lag_seconds_bucket"
    starved = {le: _router_metric(routers, control_plane, install.operator_ns, lag, le=le) for le in ("1.0", "+Inf")}
    starved_note = f"router loop wakes over 1 s late: {starved['+Inf'] - starved['1.0']:.0f} of {starved['+Inf']:.0f}"
    print(f"\n{starved_note}")
    assert resumed >= 1, (f"no stream was resumed ({starved_note}): kill (pod, answers under way its guard held "
                          f"with vLLM stopped, stops it took, resumed streams after) {kills}; "
                          f"router resumption outcomes {outcomes} (before: {resumed_before} resumed) in "
                          f"{[p['metadata']['name'] for p in routers]}, router restarts {restarts}; load ok {load.ok}, "
                          f"429 {load.shed}, errors {load.errors[:5]}")
    assert not any(restarts.values()), f"a router restarted under the load: {restarts}"
    assert load.ok > before_in > 0
    assert load.errors == [], f"{len(load.errors)} failed requests ({starved_note}): {load.errors[:5]}"

