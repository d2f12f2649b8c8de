"""Two operator processes with leader election against the real API server.

Each operator reaches the API server through its own recording proxy (plain
HTTP to the proxy, the cluster's TLS and credentials beyond it), which logs
every request it forwards and can cut the operator off the way a network
partition does: requests and open watch streams hang, nothing gets through.
The proxies' records are the evidence that one operator writes at a time,
and they time the election by its own events (a renewal stored, a renewal
relayed to the follower's watch, the follower's look at the Lease, its
takeover) rather than by the machine's speed.

Replicas run on the simulated GPU nodes; each pod IP (loopback) answers the
vLLM and guard /metrics endpoints from a small server whose KV usage the test
steps (a surge at a known instant).
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import aiohttp
import httpx
import pytest
import yaml
from aiohttp import web

from gpufleet_dev.devcluster import guard_token
from gpufleet_dev.devcluster.operator_process import OperatorProcess
from gpufleet_dev.fake_replicas import FakeReplicaMetrics
from gpufleet_kit.kube.config import KubeConfig
from tests.support.waiting import PODS_START_SECONDS, wait_for

API = "serving.gpufleet.dev/v1alpha1"
LEASE = "gpufleet-operator"
LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD = 15.0, 10.0, 2.0  # the defaults, as the chart sets them
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
              "proxy-connection", "te", "trailer"}


class RecordingProxy:
    """Forwards an operator's API requests; records (arrived, done, method, path, status), and for a watch
    each chunk it relayed with the moment it did."""

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
               "partitioned": self.partitioned, "done": None, "status": None,
               "watch": request.query.get("watch") in ("1", "true"), "chunks": []}
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
                if rec["watch"]:
                    rec["chunks"].append((time.monotonic(), chunk))
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

    def lease_watch_events(self) -> list[tuple[float, dict]]:
        """(relayed at, event) of every event the operator's Lease watches received."""
        out = []
        for r in self.records:
            if not (r["watch"] and "/leases" in r["path"]):
                continue
            pending = b""
            for at, chunk in r["chunks"]:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out += [(at, json.loads(line)) for line in lines if line.strip()]
        return sorted(out, key=lambda e: e[0])

    async def close(self) -> None:
        self.heal()
        await self.runner.cleanup()
        await self.session.close()


class Operator:
    """One `gpufleet run --leader-elect` process behind its own proxy."""

    def __init__(self, name: str, proxy: RecordingProxy, namespace: str, tmp: Path, guard_token_file: Path):
        self.name, self.proxy = name, proxy
        self.log = tmp / f"{name}.log"
        # The guard token comes from outside, as the kubelet's projected volume gives it to the chart's
        # pod: minted through this operator's proxy, it would be a write of the follower's.
        self.process = OperatorProcess(
            proxy.kubeconfig(tmp / f"{name}.kubeconfig", namespace), self.log,
            guard_token_file=guard_token_file, extra_args=(
                "--namespace", namespace, "--leader-elect", "--leader-elect-resource-namespace", namespace,
                "--leader-elect-identity", name, "--fleet-interval-seconds", "1", "--audit-interval-seconds", "3600",
                "--leader-elect-lease-duration", str(LEASE_DURATION), "--leader-elect-renew-deadline",
                str(RENEW_DEADLINE), "--leader-elect-retry-period", str(RETRY_PERIOD)))

    async def start(self) -> "Operator":
        await asyncio.to_thread(self.process.start)
        return self

    async def metric(self, name: str) -> float | None:
        """The operator's own metric; None while its endpoint does not answer (a busy machine: slowly)."""
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
                text = (await c.get(self.process.metrics_url)).text
        except httpx.HTTPError:
            return None
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    async def leader_gauge(self) -> float | None:
        """gpufleet_operator_leader: 1.0 leading, 0.0 not; None when it could not be read."""
        return await self.metric("gpufleet_operator_leader")

    async def leading(self) -> bool:
        return await self.leader_gauge() == 1.0

    async def not_leading(self) -> bool:
        """Its gauge read as 0 (an unanswered read is not taken for "stopped")."""
        return await self.leader_gauge() == 0.0

    async def ready(self) -> bool:
        async with httpx.AsyncClient(trust_env=False, timeout=2) as c:
            url = self.process.metrics_url.replace("/metrics", "/readyz")
            return (await c.get(url)).status_code == 200

    def lease_looks(self) -> list[dict]:
        """Its reads of the Lease object (not its watch), in order: each is a look at who leads."""
        return [r for r in self.proxy.records if r["method"] == "GET" and r["path"].endswith(f"/leases/{LEASE}")]

    def lease_reads_since(self, t: float) -> int:
        """The Lease reads that came back to this operator since ``t``."""
        return sum(1 for r in self.lease_looks() if r["arrived"] > t and r["done"] is not None and not r["partitioned"])

    def lease_writes(self) -> list[dict]:
        """Its Lease writes the API server stored (created or updated), in order."""
        return [r for r in self.proxy.records if r["method"] in ("PUT", "POST") and "/leases" in r["path"]
                and r["status"] in (200, 201)]

    def took_over(self) -> dict:
        """Its first stored Lease write: when it took the Lease (a follower writes the Lease only to take it)."""
        writes = self.lease_writes()
        assert writes, f"{self.name} never stored a Lease write; its Lease requests: {self.lease_requests()}"
        return writes[0]

    def lease_requests(self) -> list[tuple]:
        return [(round(r["arrived"], 3), r["method"], r["status"]) for r in self.proxy.records
                if "/leases" in r["path"] and not r["watch"]][-12:]

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
    token = await asyncio.to_thread(guard_token.mint, control_plane.kubeconfig, tmp_path / "guard-token")
    try:
        async def operator(name: str) -> Operator:
            proxy = await RecordingProxy(control_plane.kubeconfig).start()
            proxies.append(proxy)
            op = await Operator(name, proxy, namespace, tmp_path, token).start()
            ops.append(op)
            return op

        a = await operator("op-a")
        await wait_for(a.leading, timeout=60, what="op-a leading", describe=lambda: a.process.log_tail(20))
        b = await operator("op-b")
        await wait_for(b.ready, timeout=60, what="op-b ready (able to lead)", describe=lambda: b.process.log_tail(20))
        assert await b.leader_gauge() == 0.0, b.process.log_tail(20)
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


async def until(check, timeout: float, what: str, describe=None, step: float = 0.05) -> float:
    """Poll ``check`` quickly; the monotonic time it first held (a wait on the event, timed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return time.monotonic()
        await asyncio.sleep(step)
    state = f"; state: {await describe()}" if describe is not None else ""
    raise AssertionError(f"not within {timeout:g}s: {what}{state}")


def election(*ops: Operator):
    """What a failure message says of the election: each operator's leader gauge and its last Lease requests."""
    async def describe() -> str:
        return "; ".join([f"{op.name}: gauge {await op.leader_gauge()}, Lease requests (t, verb, status) "
                          f"{op.lease_requests()}" for op in ops])
    return describe


def assert_one_writer_at_a_time(first: Operator, second: Operator) -> None:
    """Every write of ``first`` was done before ``second`` took the Lease over (its first stored Lease write),
    every write of ``second`` began after it: never two writers, whatever the machine's speed. (A write
    ``first`` sent just before it was killed or cut off may finish after that: it was sent while it led, and
    it is done before the Lease changed hands.)"""
    handover = second.took_over()["arrived"]
    late = [r for r in first.proxy.writes() if (r["done"] or r["arrived"]) > handover]
    early = [r for r in second.proxy.writes() if r["arrived"] < handover]
    assert not late, f"{first.name} wrote after {second.name} took the Lease: {late[:3]}"
    assert not early, f"{second.name} wrote before it took the Lease: {early[:3]}"


# How late a follower may look at the Lease after it lapsed on its clock: its loop sleeps until that moment, so
# only its own wake-up and one request lie between (a follower that looked only every retry period, the bug
# this catches, would be up to 1.2 retry periods late).
LOOK_LATENESS = RETRY_PERIOD / 2


async def test_kill_9_of_the_leader_during_a_surge_fails_over_within_the_lease_duration(ha, kube, namespace):
    a, b, fake = ha
    await make_service(kube, namespace, fake)
    await read_calm_replica(a, namespace)
    assert await replicas(kube, namespace) == 1
    assert not b.proxy.writes(), "the follower wrote"

    killed = time.monotonic()
    a.process.proc.send_signal(signal.SIGKILL)
    fake.kv = 0.95  # a surge nobody acts on until op-b leads
    describe = election(a, b)
    await until(lambda: _is(holder(kube, namespace), "op-b"), timeout=LEASE_DURATION + 30,
                what="op-b holding the Lease after op-a's kill -9", describe=describe)
    scaled = await until(lambda: _at_least(replicas(kube, namespace), 2), timeout=30,
                         what="op-b scaling the Deployment 1 -> 2 for the surge", describe=describe)

    # Timed by the election's own events, not by when the test saw them: op-a's last renewal the API server
    # stored, the moment op-b's watch relayed it (op-b's clock starts there), op-b's look at the Lease before
    # taking it, and its takeover.
    renewed = a.lease_writes()[-1]
    took = b.took_over()
    seen = [at for at, e in b.proxy.lease_watch_events() if at < took["arrived"]
            and (e.get("object", {}).get("spec") or {}).get("holderIdentity") == "op-a"]
    looked = [r for r in b.lease_looks() if r["arrived"] < took["arrived"]][-1]
    assert seen, f"op-b's Lease watch relayed no renewal of op-a; {await describe()}"
    late = looked["arrived"] - (seen[-1] + LEASE_DURATION)
    print(f"\nkill -9 -> op-b takes the Lease: {took['arrived'] - killed:.2f}s (op-a's last renewal stored "
          f"{killed - renewed['arrived']:.2f}s before the kill; op-b looked {late:+.3f}s after it lapsed on its "
          f"clock); -> Deployment scaled 1 -> 2: {scaled - killed:.2f}s (lease {LEASE_DURATION:g}s, renew deadline "
          f"{RENEW_DEADLINE:g}s, retry {RETRY_PERIOD:g}s)")
    # Never while op-a's lease held: op-b's clock started no earlier than the renewal was sent.
    assert took["arrived"] - renewed["arrived"] >= LEASE_DURATION, \
        f"op-b took the Lease {took['arrived'] - renewed['arrived']:.2f}s after op-a's last renewal; {await describe()}"
    # At once when it lapsed: op-b's look that took it came right when the lease ran out on its clock.
    assert late <= LOOK_LATENESS, (f"op-b looked at the lapsed Lease {late:.2f}s after it ran out on its clock "
                                   f"(its watch relayed op-a's last renewal at {seen[-1]:.3f}); {await describe()}")
    # The warm follower acts first: the scale-out follows the takeover (docs/high-availability.md).
    assert scaled - took["arrived"] <= 5, f"scaled {scaled - took['arrived']:.2f}s after op-b took the Lease"

    assert_one_writer_at_a_time(a, b)
    assert [r for r in b.proxy.writes()], "op-b never acted"
    # Every field the operator sets on the Deployment is owned by its one field manager.
    dep = await kube.get("apps/v1", "Deployment", "svc-engine", namespace)
    appliers = {m["manager"] for m in dep["metadata"]["managedFields"] if m["operation"] == "Apply"}
    assert appliers == {"gpufleet"}
    await wait_for(lambda: _event_says(kube, namespace, "op-b became leader"), timeout=30,
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
    describe = election(a, b)
    a_stopped = await until(a.not_leading, timeout=RENEW_DEADLINE + 15, what="op-a's gauge saying it stopped leading",
                            describe=describe)
    b_started = await until(b.leading, timeout=LEASE_DURATION + 30, what="op-b's gauge saying it leads",
                            describe=describe)
    await until(lambda: _at_least(replicas(kube, namespace), 2), timeout=30,
                what="op-b scaling the Deployment 1 -> 2 for the surge", describe=describe)
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
    assert_one_writer_at_a_time(a, b)
    assert "stopped leading" in a.log_text()

    # Healed: op-a sees op-b's Lease and follows; it writes nothing.
    a.proxy.heal()
    healed = time.monotonic()
    await wait_for(a.ready, timeout=LEASE_DURATION + 30, what="op-a able to lead again (reaches the Lease)")
    await wait_for(lambda: a.lease_reads_since(healed) >= 2, timeout=LEASE_DURATION + 30,
                   what="op-a reading the Lease (op-b's) twice since the heal", describe=describe)
    gauges = (await a.leader_gauge(), await b.leader_gauge())
    assert gauges == (0.0, 1.0), f"leader gauges (op-a, op-b) after the heal: {gauges}; {await describe()}"
    assert not [r for r in a.proxy.writes() if r["arrived"] > healed]


async def test_sigterm_hands_the_lease_over_at_once(ha, kube, namespace):
    a, b, _fake = ha
    stopped = time.monotonic()
    await asyncio.to_thread(a.process.stop)
    describe = election(a, b)
    await until(lambda: _is(holder(kube, namespace), "op-b"), timeout=LEASE_DURATION,
                what="op-b holding the Lease op-a released", describe=describe)
    # "At once": op-b takes it at its first look after the release, not when a lease would have lapsed.
    # Timed by the events (the release op-a's proxy relayed, op-b's looks), not by the machine's speed.
    released = a.lease_writes()[-1]
    took = b.took_over()
    released_at = released["done"] or released["arrived"]
    looks = [r["arrived"] for r in b.lease_looks() if released_at < r["arrived"] < took["arrived"]]
    print(f"\nSIGTERM -> op-a released the Lease: {released['arrived'] - stopped:.2f}s; -> op-b holds it: "
          f"{took['arrived'] - stopped:.2f}s, after {len(looks)} look(s) since the release")
    assert released["arrived"] > stopped, f"op-a's last Lease write came before its SIGTERM: {await describe()}"
    assert "released Lease" in a.log_text(), a.process.log_tail(20)
    assert took["arrived"] > released["arrived"] and len(looks) <= 1, \
        f"op-b looked at the released Lease {len(looks)} times before taking it; {await describe()}"
    await wait_for(b.leading, timeout=30, what="op-b's gauge saying it leads", describe=describe)


async def _is(value, wanted) -> bool:
    return (await value) == wanted


async def _at_least(value, wanted) -> bool:
    return (await value) >= wanted


async def _not(value) -> bool:
    return not await value


async def _event_says(kube, namespace: str, text: str) -> bool:
    events = await kube.list("v1", "Event", namespace, field_selector=f"involvedObject.name={LEASE}")
    return any(text in e.get("message", "") for e in events)

