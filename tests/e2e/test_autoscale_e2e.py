"""The whole loop with real engines, as one scenario in named stages (see
conftest: a stage runs only when every earlier one passed).

The service becomes Ready; its pod takes work only through its guard (the pod's address refuses vLLM's
port); traffic is served through the guard; load drives
KV usage over the high watermark and the operator scales out; the operator
is killed mid-scale-out and its successor converges; the new replica serves;
load drops and the operator scales in after the stabilization window while
the replica that goes drains (no error other than 429 across the run); an
on-demand audit is reported; the dashboards' key panels have data."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import socket
import uuid
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
import yaml

from gpufleet.manifests import names
from gpufleet.reconcile import conditions as c
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH, GUARD_METRICS_PATH
from gpufleet_dev.demo.load import EndpointLoad, RequestResult
from gpufleet_dev.demo.prometheus import LocalPrometheus
from gpufleet_dev.devcluster.engines import pod_loopback
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.pods import is_serving
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.stages]

API = "serving.gpufleet.dev/v1alpha1"
SERVICE = "tiny"
MAX_TOKENS = 96
# The per-service dashboard's key panels: their queries must return data.
KEY_PANELS = ("Replicas ready / desired", "KV-cache usage against the watermarks", "Time to first token",
              "Tokens per second", "Requests by outcome", "Batch fill")
DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "gpufleet-service.json"
# The operator's start and its first reconcile, under the load of two engines and eight streaming clients
# on two cores.
OPERATOR_START_SECONDS = 120


def key_panel_queries(namespace: str, service: str) -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    out = []
    for p in panels:
        if p["title"] in KEY_PANELS:
            for t in p["targets"]:
                expr = t["expr"].replace("$namespace", namespace).replace("$service", service)
                out.append((p["title"], expr.replace("$__rate_interval", "5m")))
    assert {t for t, _ in out} == set(KEY_PANELS), "a key panel was renamed in the dashboard"
    return out


def tiny_service():
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": SERVICE}, "spec": {
        "model": {"name": "tiny-llama", "maxModelLen": 1024},
        "engine": {"runtime": "vllm-cpu", "dtype": "float32", "maxNumSeqs": 16, "extraArgs": ["--enforce-eager"],
                   "kvCache": {"blockSize": 32, "numBlocksOverride": 64, "cpuKvCacheSpaceGiB": 1}},
        "isolation": {"mode": "Exclusive", "nodePool": "local", "tolerations": [
            {"key": "gpufleet.dev/local-engine", "operator": "Exists", "effect": "NoSchedule"}]},
        "admission": {"requestTimeoutSeconds": 60, "kvWatermarkPercent": 15},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "kvHighWatermarkPercent": 60,
                        "kvLowWatermarkPercent": 30, "scaleDownStabilizationSeconds": 15, "maxScaleUpStep": 1}}}


@dataclasses.dataclass
class Scenario:
    """What the stages share: the cluster objects, the operator of the moment, the running load."""
    control_plane: object
    kube: KubeClient
    namespace: str
    work_dir: Path
    op: OperatorProcess
    prom: LocalPrometheus | None
    clients: int = 8
    load: EndpointLoad | None = None
    load_stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    load_task: asyncio.Task | None = None

    def start_operator(self, n: int, metrics_port: int | None = None) -> OperatorProcess:
        # Started while the load keeps both cores busy: its imports and first listing take far longer
        # than on a quiet machine (start's default waits 30 s for its metrics endpoint).
        return OperatorProcess(self.control_plane.kubeconfig, self.work_dir / f"operator-{n}.log",
                               ("--namespace", self.namespace, "--audit-interval-seconds", "5"),
                               metrics_port=metrics_port).start(timeout=OPERATOR_START_SECONDS)

    async def service(self) -> dict:
        return await self.kube.get(API, "InferenceService", SERVICE, self.namespace)

    async def pods(self) -> list[dict]:
        return await self.kube.list("v1", "Pod", self.namespace, label_selector=names.selector_string(SERVICE))

    def start_load(self) -> None:
        self.load = EndpointLoad(self.kube, self.namespace, SERVICE, "tiny-llama", prompt_tokens=200,
                                 max_tokens=MAX_TOKENS)
        self.load_task = asyncio.create_task(
            self.load.run(lambda _t: self.clients, self.load_stop, max_clients=8))

    async def stop_load(self) -> list[RequestResult]:
        self.load_stop.set()
        return await self.load_task if self.load_task else []

    def served_by(self) -> set[str]:
        """Pod IPs that completed a request."""
        return {r.endpoint.split("//")[1].split(":")[0] for r in (self.load.results if self.load else [])
                if r.status == 200}

    async def observed(self) -> str:
        """The state a failing stage reports: service status, pods, request outcomes, operator log."""
        lines = []
        try:
            st = (await self.service()).get("status") or {}
            conds = {x["type"]: f"{x['status']}/{x.get('reason')}" for x in st.get("conditions") or []}
            lines.append(f"service: desired={st.get('desiredReplicas')} ready={st.get('readyReplicas')} "
                         f"lastScaling={st.get('lastScaling')} conditions={conds}")
            lines.append("pods: " + ", ".join(
                f"{p['metadata']['name']}@{(p.get('status') or {}).get('podIP')} "
                f"{'serving' if is_serving(p) else (p.get('status') or {}).get('phase')}"
                for p in await self.pods()))
        except Exception as e:  # the report must not hide the failure it describes
            lines.append(f"(cannot read the service: {e})")
        if self.load:
            outcomes = collections.Counter(r.status for r in self.load.results)
            lines.append(f"requests by status: {dict(outcomes)}; served by {sorted(self.served_by())}")
        lines.append("operator log:\n" + self.op.log_tail(10))
        return "\n".join(lines)

    async def wait(self, check, *, timeout: float, what: str):
        return await wait_for(check, timeout=timeout, what=what, describe=self.observed)

    async def ready_replicas(self, n: int) -> dict | None:
        o = await self.service()
        st = o.get("status") or {}
        return o if st.get("readyReplicas") == n and \
            (c.get(st.get("conditions"), "Ready") or {}).get("status") == "True" else None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scenario(control_plane, crds_installed, engine_nodes, tmp_path_factory):
    kube = control_plane.client()
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {"gpufleet.dev/test": "true"}}})
    work_dir = tmp_path_factory.mktemp("autoscale-e2e")
    s = prom = follower = None
    try:
        op = OperatorProcess(control_plane.kubeconfig, work_dir / "operator-1.log",
                             ("--namespace", namespace, "--audit-interval-seconds", "5")).start()
        s = Scenario(control_plane, kube, namespace, work_dir, op, None)
        s.prom = prom = LocalPrometheus(work_dir / "prometheus", f"127.0.0.1:{op.metrics_port}").start()
        follower = asyncio.create_task(prom.follow_pods(kube))
        yield s
    finally:
        if s is not None:
            s.load_stop.set()
            if s.load_task:
                s.load_task.cancel()
                await asyncio.gather(s.load_task, return_exceptions=True)
            s.op.stop()
        if follower:
            follower.cancel()
        if prom:
            prom.stop()
        await kube.delete("v1", "Namespace", namespace)
        await kube.close()


async def test_service_becomes_ready(scenario):
    scenario.control_plane.kubectl("apply", "-n", scenario.namespace, "-f", "-", input=yaml.safe_dump(tiny_service()))
    await scenario.wait(lambda: scenario.ready_replicas(1), timeout=300, what="the first real engine replica Ready")


def refused(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        try:
            s.connect((host, port))
        except ConnectionRefusedError:
            return True
    return False


async def test_the_pods_address_refuses_vllms_port_and_the_guard_serves_both_metric_sets(scenario):
    """An engine pod takes work only through its guard (docs/security.md): vLLM listens on the pod's loopback,
    so the pod's address refuses vLLM's port, while a completion through the guard and both metric sets (the
    guard's and, through the guard, vLLM's) work. On the engine backer's real vllm-cpu and guard, configured
    from the guard.json the operator rendered; before any load, so the guard's counts are this request's."""
    (pod,) = await scenario.pods()
    ip = pod["status"]["podIP"]
    assert await asyncio.to_thread(refused, ip, names.ENGINE_PORT)
    guard = f"http://{ip}:{names.GUARD_PORT}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{pod_loopback(ip)}:{names.ENGINE_PORT}/health") as r:
            assert r.status == 200
        async with http.post(f"{guard}/v1/completions",
                             json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["usage"]["completion_tokens"] >= 1

        async def counted() -> str | None:
            async with http.get(guard + GUARD_METRICS_PATH) as r:
                text = await r.text()
            return text if 'gpufleet_guard_requests_total{class="standard",outcome="ok"} 1.0' in text else None
        # The guard counts a request once its answer is written, which the client may read first.
        await wait_for(counted, timeout=30, interval=0.1, what="the guard to count the one request it served")
        async with http.get(guard + ENGINE_METRICS_PATH) as r:
            assert r.status == 200
            engine_metrics = await r.text()
    # vLLM's own names, unchanged: the request the guard forwarded is counted there too.
    assert "vllm:request_success_total{" in engine_metrics
    assert "vllm:kv_cache_usage_perc{" in engine_metrics


async def test_traffic_is_served_through_the_guard(scenario):
    scenario.start_load()
    await scenario.wait(lambda: [r for r in scenario.load.results if r.status == 200], timeout=120,
                        what="a first completed request")
    done = next(r for r in scenario.load.results if r.status == 200)
    assert done.endpoint.endswith(f":{names.GUARD_PORT}") and done.tokens == MAX_TOKENS, done
    last: list[list[str]] = [[]]
    async with aiohttp.ClientSession() as http:
        async def counted() -> bool:
            async with http.get(f"{done.endpoint}/metrics") as r:
                text = await r.text()
            last[0] = [line for line in text.splitlines()
                       if line.startswith("gpufleet_guard_requests_total{") and 'outcome="ok"' in line]
            return sum(float(line.split()[-1]) for line in last[0]) >= 1
        # The guard counts a stream once its end is written, which the client may read first.
        await wait_for(counted, timeout=30, interval=0.2, what="the guard to count the request it served",
                       describe=lambda: f"its ok counters {last[0]}")


async def test_load_scales_out(scenario):
    # Load pushes KV usage over 60%: the operator decides to scale out.
    async def scaled_out():
        o = await scenario.service()
        return o if (o.get("status") or {}).get("desiredReplicas") == 2 else None
    obj = await scenario.wait(scaled_out, timeout=120, what="the operator to scale out")
    assert obj["status"]["lastScaling"]["reason"] in ("KVHighWatermark", "Shedding", "QueueDepth", "QueueTime"), \
        obj["status"]["lastScaling"]
    await scenario.wait(lambda: _event_reasons(scenario, "ScaledUp"), timeout=30, what="a ScaledUp Event")


async def test_a_restarted_operator_converges(scenario):
    # Killed in the middle of the scale-out; its successor must finish it without duplicates.
    scenario.op.stop(sig_kill=True)
    scenario.op = scenario.start_operator(2, metrics_port=scenario.op.metrics_port)

    async def deployment_at_2():
        d = await scenario.kube.get_or_none("apps/v1", "Deployment", f"{SERVICE}-engine", scenario.namespace)
        return d if d and d["spec"]["replicas"] == 2 else None
    dep = await scenario.wait(deployment_at_2, timeout=OPERATOR_START_SECONDS,
                              what="the Deployment at 2 replicas after the restart")
    kube, ns = scenario.kube, scenario.namespace
    assert len(await kube.list("apps/v1", "Deployment", ns)) == 1
    assert len(await kube.list("v1", "Service", ns)) == 1
    assert len(await kube.list("v1", "ConfigMap", ns, label_selector="app.kubernetes.io/managed-by=gpufleet")) == 1
    assert dep["metadata"]["ownerReferences"][0]["name"] == SERVICE


async def test_the_new_replica_serves(scenario):
    await scenario.wait(lambda: scenario.ready_replicas(2), timeout=300, what="the second replica Ready")
    ips = {p["status"]["podIP"] for p in await scenario.pods()}
    await scenario.wait(lambda: ips <= scenario.served_by(), timeout=120,
                        what=f"both replicas ({sorted(ips)}) to answer requests")


async def test_scale_in_after_the_lull_drains(scenario):
    # Light load: KV stays under the low watermark; after the window the operator scales in
    # while a request stream still runs, and the removed replica drains it.
    scenario.clients = 1

    async def scaled_in():
        o = await scenario.service()
        st = o.get("status") or {}
        return o if st.get("desiredReplicas") == 1 and st.get("readyReplicas") == 1 else None
    obj = await scenario.wait(scaled_in, timeout=180, what="the operator to scale in")
    assert obj["status"]["lastScaling"]["reason"] == "KVLowWatermark", obj["status"]["lastScaling"]

    async def one_pod_left():
        return len(await scenario.pods()) == 1
    await scenario.wait(one_pod_left, timeout=120, what="the drained pod to be gone")
    results = await scenario.stop_load()
    ok = [r for r in results if r.status == 200]
    shed = [r for r in results if r.status == 429]
    other = [r for r in results if r.status not in (200, 429)]
    assert ok, "no request succeeded"
    assert not other, f"requests lost or failed (not 429): {[(r.status, r.error) for r in other[:5]]}"
    assert all(r.retry_after for r in shed), "a 429 came without Retry-After"
    short = [r for r in ok if r.tokens != MAX_TOKENS]
    assert not short, f"completed streams cut short: {[(r.endpoint, r.tokens) for r in short[:5]]}"
    await scenario.wait(lambda: _event_reasons(scenario, "ScaledDown"), timeout=30, what="a ScaledDown Event")


async def test_on_demand_audit_is_reported(scenario):
    # The fragmentation audit collects the real /audit report of the replica: on CPU it
    # says what cannot be measured instead of inventing numbers.
    scenario.control_plane.kubectl("-n", scenario.namespace, "annotate", f"inferenceservice/{SERVICE}",
                                   "gpufleet.dev/audit-requested=now", "--overwrite")

    async def audited():
        o = await scenario.service()
        done = "gpufleet.dev/audit-requested" not in (o["metadata"].get("annotations") or {})
        return o if done and (o.get("status") or {}).get("fragmentation") else None
    obj = await scenario.wait(audited, timeout=30, what="the on-demand fragmentation audit")
    frag = obj["status"]["fragmentation"]
    assert frag["verdict"] == "Unavailable" and frag.get("percent") is None, frag
    assert "CUDA" in frag["recommendation"] or "cpu" in frag["recommendation"].lower(), frag
    assert c.get(obj["status"]["conditions"], "FragmentationOK")["reason"] == "Unavailable"


async def test_dashboard_key_panels_have_data(scenario):
    # In a real Prometheus scraping the engines, guards and operator (every 2 s; a panel's rate needs two
    # scrapes of a series, and the restarted operator's and the remaining replica's are the newest).
    queries = key_panel_queries(scenario.namespace, SERVICE)
    empty: list[list[tuple[str, str]]] = [queries]

    def all_have_data() -> bool:
        empty[0] = [(title, expr) for title, expr in queries if not scenario.prom.query(expr)]
        return not empty[0]
    await wait_for(all_have_data, timeout=60, what="every key panel's query to return data",
                   describe=lambda: f"dashboard panels without data: {empty[0]}")


async def _event_reasons(scenario: Scenario, reason: str) -> bool:
    events = await scenario.kube.list("v1", "Event", scenario.namespace,
                                      field_selector=f"involvedObject.name={SERVICE}")
    return any(e["reason"] == reason for e in events)
