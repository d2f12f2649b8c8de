"""Two operator processes with leader election against the real API server.

Each operator reaches the API server through its own recording proxy (plain
HTTP to the proxy, the cluster's TLS and credentials beyond it), which logs
every request it forwards and can cut the operator off the way a network
partition does: requests and open watch streams hang, nothing gets through.
The proxies' records are the evidence that one operator writes at a time.

Replicas run on the simulated GPU nodes; each pod IP (loopback) answers the
vLLM and guard /metrics endpoints from a small server whose KV usage the test
steps (a surge at a known instant).
"""
from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
import yaml
from aiohttp import web
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from gpufleet_dev.fake_replicas import FakeReplicaMetrics

from gpufleet.kube.config import KubeConfig
from tests.support.waiting import PODS_START_SECONDS, wait_for

API = "serving.gpufleet.dev/v1alpha1"
LEASE = "gpufleet-operator"
LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 15.0, 10.0, 2.0  # the defaults, as the chart sets them
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
              "proxy-connection", "te", "trailer"}


class RecordingProxy:
    """Forwards an operator's API requests; records (arrived, done, method, path, status)."""

    def __init__(self, kubeconfig: str):
        self.creds = KubeConfig.from_file(kubeconfig).current
        self.ssl = self.creds.ssl_context()
        self.records: list[dict] = []
        self.partitioned = False
        self._cut = asyncio.Event()  # never set: what a partitioned request waits for

    async def start(self) -> "RecordingProxy":
        self.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    def kubeconfig(self, path: Path, namespace: str) -> str:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "proxy",
            "clusters": [{"name": "proxy", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "proxy", "user": {}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy",
                                                       "namespace": namespace}}]}))
        return str(path)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        rec = {"arrived": time.monotonic(), "method": request.method, "path": request.path,
               "partitioned": self.partitioned, "done": None, "status": None}
        self.records.append(rec)
        if self.partitioned:
            await self._dropped(request)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.creds.authorization:
            headers["Authorization"] = self.creds.authorization
        async with self.session.request(request.method, self.creds.server + request.path_qs, headers=headers,
                                        data=body or None, ssl=self.ssl) as up:
            rec["status"] = up.status
            resp = web.StreamResponse(status=up.status, headers={
                k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                if self.partitioned:  # packets of an open stream are dropped too
                    await self._dropped(request)
                await resp.write(chunk)
            rec["done"] = time.monotonic()
            await resp.write_eof()
            return resp

    async def _dropped(self, request: web.Request) -> None:
        """Hang like a request into a partition; once healed, reset the connection rather than
        deliver a request its client gave up on long ago."""
        await self._cut.wait()
        if request.transport is not None:
            request.transport.close()
        raise asyncio.CancelledError

    def heal(self) -> None:
        self.partitioned = False
        cut, self._cut = self._cut, asyncio.Event()
        cut.set()

    def writes(self, exclude_lease: bool = True) -> list[dict]:
        """Writes that reached the API server (a partitioned request never does)."""
        return [r for r in self.records if r["method"] != "GET" and not r["partitioned"]
                and not (exclude_lease and "/leases" in r["path"])]

    def attempted_writes(self) -> list[dict]:
        return [r for r in self.records if r["method"] != "GET" and "/leases" not in r["path"]]

    async def close(self) -> None:
        self.heal()
        await self.runner.cleanup()
        await self.session.close()


class Operator:
    """One `gpufleet run --leader-elect` process behind its own proxy."""

    def __init__(self, name: str, proxy: RecordingProxy, namespace: str, tmp: Path):
        self.name, self.proxy = name, proxy
        self.log = tmp / f"{name}.log"
        self.process = OperatorProcess(
            proxy.kubeconfig(tmp / f"{name}.kubeconfig", namespace), self.log,
            ("--namespace", namespace, "--leader-elect", "--leader-elect-resource-namespace", namespace,
             "--leader-elect-identity", name, "--fleet-interval-seconds", "1", "--audit-interval-seconds", "3600",
             "--leader-elect-lease-duration", str(LEASE_DURATION), "--leader-elect-renew-deadline",
             str(RENEW_DEADLINE), "--leader-elect-retry-period", str(RETRY_PERIOD)))

    async def start(self) -> "Operator":
        await asyncio.to_thread(self.process.start)
        return self

    async def metric(self, name: str) -> float | None:
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=2) as c:
                text = (await c.get(self.process.metrics_url)).text
        except httpx.HTTPError:
            return None
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    async def leading(self) -> bool:
        return await self.metric("gpufleet_operator_leader") == 1.0

    async def ready(self) -> bool:
        async with httpx.AsyncClient(trust_env=False, timeout=2) as c:
            url = self.process.metrics_url.replace("/metrics", "/readyz")
            return (await c.get(url)).status_code == 200

    def lease_reads_since(self, t: float) -> int:
        """The Lease reads that came back to this operator since ``t``: each is a look at who leads."""
        return sum(1 for r in self.proxy.records if r["method"] == "GET" and "/leases" in r["path"]
                   and r["arrived"] > t and r["done"] is not None and not r["partitioned"])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
async def ha(control_plane, crds_installed, namespace, kube, tmp_path, request):
    """Two operators for ``namespace`` (A leads), the fake replica metrics, and teardown.
    An operator the session started for other tests would act on this namespace too:
    it is paused while these tests run."""
    paused = _session_operator(request)
    if paused:
        paused.send_signal(signal.SIGSTOP)
    fake = FakeReplicaMetrics()
    ops: list[Operator] = []
    proxies: list[RecordingProxy] = []
    try:
        async def operator(name: str) -> Operator:
            proxy = await RecordingProxy(control_plane.kubeconfig).start()
            proxies.append(proxy)
            op = await Operator(name, proxy, namespace, tmp_path).start()
            ops.append(op)
            return op

        a = await operator("op-a")
        await wait_for(a.leading, timeout=20, what="op-a leading", describe=lambda: a.process.log_tail(20))
        b = await operator("op-b")
        await wait_for(b.ready, timeout=20, what="op-b ready (able to lead)", describe=lambda: b.process.log_tail(20))
        assert not await b.leading()
        yield a, b, fake
    finally:
        for op in ops:
            op.process.stop()
        for proxy in proxies:
            await proxy.close()
        await fake.close()
        if paused:
            paused.send_signal(signal.SIGCONT)


def _session_operator(request):
    defs = request.session._fixturemanager.getfixturedefs("operator", request.node) or ()
    for d in defs:
        cached = getattr(d, "cached_result", None)
        if cached and cached[0] is not None and getattr(cached[0], "proc", None) and cached[0].proc.poll() is None:
            return cached[0].proc
    return None


async def make_service(kube, namespace: str, fake: FakeReplicaMetrics) -> None:
    await kube.create({"apiVersion": API, "kind": "InferenceService",
                       "metadata": {"name": "svc", "namespace": namespace},
                       "spec": {"model": {"name": "org/m"}, "isolation": {"mode": "Shared"},
                                "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "maxScaleUpStep": 1,
                                                "scaleDownStabilizationSeconds": 3600}}})

    async def one_ready_and_served():
        d = await kube.get_or_none("apps/v1", "Deployment", "svc-engine", namespace)
        if not d or d.get("status", {}).get("readyReplicas") != 1:
            return False
        for p in await kube.list("v1", "Pod", namespace, label_selector="gpufleet.dev/service=svc"):
            if p["status"].get("podIP"):
                await fake.serve(p["status"]["podIP"])
        return True
    await wait_for(one_ready_and_served, timeout=PODS_START_SECONDS, what="one ready replica")


async def read_calm_replica(op: Operator, namespace: str) -> None:
    """``op`` has read the replica's calm KV usage (its own gauge says so)."""
    gauge = f'gpufleet_service_kv_usage_ratio{{namespace="{namespace}",service="svc"}}'
    await wait_for(lambda: _is(op.metric(gauge), 0.5), timeout=30, what=f"{op.name} reading the calm replica",
                   describe=lambda: op.process.log_tail(20))


async def replicas(kube, namespace: str) -> int:
    d = await kube.get_or_none("apps/v1", "Deployment", "svc-engine", namespace)
    return d["spec"]["replicas"] if d else 0


async def holder(kube, namespace: str) -> str | None:
    lease = await kube.get_or_none("coordination.k8s.io/v1", "Lease", LEASE, namespace)
    return (lease or {}).get("spec", {}).get("holderIdentity") or None


async def until(check, timeout: float, step: float = 0.05) -> float:
    """Poll ``check`` quickly; the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return time.monotonic()
        await asyncio.sleep(step)
    raise AssertionError(f"not within {timeout}s")


def assert_one_writer_at_a_time(first, second, handover: float) -> None:
    """Every write of ``first`` was done before ``handover``, every write of ``second`` began after it."""
    late = [r for r in first.proxy.writes() if (r["done"] or r["arrived"]) > handover]
    early = [r for r in second.proxy.writes() if r["arrived"] < handover]
    assert not late, f"{first.name} wrote after the handover: {late[:3]}"
    assert not early, f"{second.name} wrote before it led: {early[:3]}"


async def test_kill_9_of_the_leader_during_a_surge_fails_over_within_the_lease_duration(ha, kube, namespace):
    a, b, fake = ha
    await make_service(kube, namespace, fake)
    await read_calm_replica(a, namespace)
    assert await replicas(kube, namespace) == 1
    assert not b.proxy.writes(), "the follower wrote"

    killed = time.monotonic()
    a.process.proc.send_signal(signal.SIGKILL)
    fake.kv = 0.95  # a surge nobody acts on until op-b leads
    acquired = await until(lambda: _is(holder(kube, namespace), "op-b"), timeout=LEASE_DURATION + 10)
    scaled = await until(lambda: _at_least(replicas(kube, namespace), 2), timeout=15)
    takeover_s, scale_out_s = acquired - killed, scaled - killed
    print(f"\nkill -9 -> op-b holds the Lease: {takeover_s:.2f}s; -> Deployment scaled 1 -> 2: "
          f"{scale_out_s:.2f}s (lease {LEASE_DURATION:g}s, renew deadline {RENEW_DEADLINE:g}s, "
          f"retry {RETRY_PERIOD:g}s)")
    assert takeover_s <= LEASE_DURATION + 0.5, f"takeover took {takeover_s:.2f}s"
    assert scale_out_s <= takeover_s + 5

    b_first_lease_write = min(r["arrived"] for r in b.proxy.records
                              if r["method"] in ("PUT", "POST") and "/leases" in r["path"])
    assert_one_writer_at_a_time(a, b, handover=min(killed, b_first_lease_write))
    assert [r for r in b.proxy.writes()], "op-b never acted"
    # Every field the operator sets on the Deployment is owned by its one field manager.
    dep = await kube.get("apps/v1", "Deployment", "svc-engine", namespace)
    appliers = {m["manager"] for m in dep["metadata"]["managedFields"] if m["operation"] == "Apply"}
    assert appliers == {"gpufleet"}
    await wait_for(lambda: _event_says(kube, namespace, "op-b became leader"), timeout=10,
                   what="an Event on the Lease naming the new leader")
    assert "became leader" in b.log_text() and await b.metric(
        'gpufleet_operator_leader_transitions_total{transition="acquired"}') == 1.0


async def test_a_partitioned_leader_stops_acting_before_the_follower_starts(ha, kube, namespace):
    a, b, fake = ha
    await make_service(kube, namespace, fake)
    await read_calm_replica(a, namespace)

    cut = time.monotonic()
    a.proxy.partitioned = True
    fake.kv = 0.95  # op-a sees the surge but can write nothing; op-b must act once it leads
    a_stopped = await until(lambda: _not(a.leading()), timeout=RENEW_DEADLINE + 5)
    b_started = await until(b.leading, timeout=LEASE_DURATION + 10)
    await until(lambda: _at_least(replicas(kube, namespace), 2), timeout=15)
    print(f"\npartition -> op-a stops acting: {a_stopped - cut:.2f}s; -> op-b leads: {b_started - cut:.2f}s "
          f"(gap {b_started - a_stopped:.2f}s)")
    assert a_stopped - cut <= RENEW_DEADLINE + 1.0  # its gauge is set when its loop wakes at the deadline
    assert b_started - a_stopped >= (LEASE_DURATION - RENEW_DEADLINE) - 2.5, "no margin between the leaders"
    # op-a's client refuses writes once its lease's renew deadline passed, before sending them. A write that
    # passed that check just before the deadline can still reach the API server a moment after the test saw
    # op-a stop (the proxy's clock, a loaded machine): what must hold is that none arrives once op-b leads.
    after = [r for r in a.proxy.attempted_writes() if r["arrived"] > b_started]
    assert not after, f"op-a tried to write after op-b began leading: {after[:3]}"
    straggling = [r for r in a.proxy.attempted_writes() if r["arrived"] > a_stopped]
    if straggling:
        print(f"op-a writes that arrived after it was seen to stop (checked before its deadline): "
              f"{[(round(r['arrived'] - a_stopped, 3), r['method'], r['path']) for r in straggling]}")
    assert_one_writer_at_a_time(a, b, handover=cut)
    assert "stopped leading" in a.log_text()

    # Healed: op-a sees op-b's Lease and follows; it writes nothing.
    a.proxy.heal()
    healed = time.monotonic()
    await wait_for(a.ready, timeout=LEASE_DURATION + 10, what="op-a able to lead again (reaches the Lease)")
    await wait_for(lambda: a.lease_reads_since(healed) >= 2, timeout=LEASE_DURATION + 10,
                   what="op-a reading the Lease (op-b's) twice since the heal")
    assert not await a.leading() and await b.leading()
    assert not [r for r in a.proxy.writes() if r["arrived"] > healed]


async def test_sigterm_hands_the_lease_over_at_once(ha, kube, namespace):
    a, b, _fake = ha
    stopped = time.monotonic()
    await asyncio.to_thread(a.process.stop)
    acquired = await until(lambda: _is(holder(kube, namespace), "op-b"), timeout=LEASE_DURATION)
    print(f"\nSIGTERM -> op-a released -> op-b holds the Lease: {acquired - stopped:.2f}s")
    assert acquired - stopped <= RETRY_PERIOD + 1.0
    assert "released Lease" in a.log_text()
    assert await b.leading()


async def _is(value, wanted) -> bool:
    return (await value) == wanted


async def _at_least(value, wanted) -> bool:
    return (await value) >= wanted


async def _not(value) -> bool:
    return not await value


async def _event_says(kube, namespace: str, text: str) -> bool:
    events = await kube.list("v1", "Event", namespace, field_selector=f"involvedObject.name={LEASE}")
    return any(text in e.get("message", "") for e in events)

