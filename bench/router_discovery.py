"""Router discovery on the local control plane: watching against listing every 2 s (the baseline),
in the same run, with N InferenceServices (default 1000) of one engine pod each.

The pods are simulated: created with a scheduler name nobody serves, so no node and no kwok
stage touches them, and their status (address, Ready) is written by this script, as a
kubelet would. The routers are gpufleet's own (the router's Fleet and discovery.py, the
command's code path without the HTTP front), in this process.

(a) Ready to routable: the time from a pod's status PATCH to Ready being sent to the router's
    route table holding the pod as a serving replica (the update that also releases requests
    held for the service), for ``--samples`` pods per discovery mode, in alternating rounds, each
    PATCH at a random phase of the listing. p50, p90 and the worst, and list/watch.
(b) API load of two routers over ``--window`` seconds while ``--churn`` pods a second change
    readiness: the API requests a second (the routers' own count, KubeClient's on_request; a
    watch counts once, when it opens) and the bytes a second between the API server and the
    routers (counted on the wire, TLS included, by a relay in front of the API server for each
    router); the first sync apart. Ratios list/watch.

    .venv/bin/python bench/router_discovery.py [--n 1000] [--samples 20] [--window 60] [--churn 1]
        [--json reports/router_discovery.json]

Needs the local control plane (gpufleet dev up); takes about --n / 50 s to create the objects.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cluster import client, ensure_cluster, fresh_namespace  # noqa: E402

from gpufleet.manifests import names  # noqa: E402
from gpufleet_api import API_VERSION, KIND  # noqa: E402
from gpufleet_kit.kube.client import KubeClient  # noqa: E402
from gpufleet_kit.kube.config import KubeConfig  # noqa: E402
from gpufleet_kit.kube.errors import Invalid  # noqa: E402
from gpufleet_router import discovery  # noqa: E402
from gpufleet_router.metrics import RouterMetrics  # noqa: E402
from gpufleet_router.policy.table import Table  # noqa: E402
from gpufleet_router.server import Fleet, RouterSettings  # noqa: E402

MODES = (discovery.Discovery.WATCH, discovery.Discovery.LIST)
UNSERVED_SCHEDULER = "gpufleet-bench-unscheduled"
LIST_INTERVAL = RouterSettings().discovery_interval


def service(ns: str, i: int) -> dict:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": f"svc-{i:04d}", "namespace": ns},
            "spec": {"model": {"name": f"org/model-{i:04d}"}, "isolation": {"mode": "Shared"},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}}


def pod(ns: str, i: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"svc-{i:04d}-engine-0", "namespace": ns,
                         "labels": names.selector_labels(f"svc-{i:04d}")},
            "spec": {"schedulerName": UNSERVED_SCHEDULER,
                     "containers": [{"name": "engine", "image": "gpufleet-bench/none:0"}]}}


def pod_status(i: int, ready: bool) -> dict:
    ip = f"10.250.{i // 250}.{i % 250 + 1}"
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                       "lastTransitionTime": now}]}}


class ByteRelay:
    """A TCP relay in front of the API server that counts the bytes each way (TLS passes through)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.down = 0   # from the API server
        self.up = 0

    async def start(self) -> "ByteRelay":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.listen_port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, downstream: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    if downstream:
                        self.down += len(data)
                    else:
                        self.up += len(data)
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()
        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


def config_via(kubeconfig: str, relay: ByteRelay | None) -> KubeConfig:
    if relay is None:
        return KubeConfig.from_file(kubeconfig)

    def load():
        creds = KubeConfig.from_file(kubeconfig).current
        url = urlparse(creds.server)
        host = url.hostname
        return dataclasses.replace(creds, server=f"{url.scheme}://127.0.0.1:{relay.listen_port}",
                                   tls_server_name=creds.tls_server_name or (host if host != "127.0.0.1" else None))
    return KubeConfig(load, f"kubeconfig {kubeconfig} through a byte-counting relay")


class BenchRouter:
    """A router's discovery and route table, noting when each pod first appears serving."""

    def __init__(self, kubeconfig: str, namespace: str, mode: str, relay: ByteRelay | None = None):
        self.requests: collections.Counter = collections.Counter()
        self.relay = relay

        def counted(verb: str, resource: str, status: int) -> None:
            self.requests[verb, resource] += 1
        settings = RouterSettings(namespaces=(namespace,), discovery=mode, discovery_interval=LIST_INTERVAL)
        self.kube = KubeClient(config_via(kubeconfig, relay), on_request=counted,
                               connection_limit=discovery.connections_needed(settings.namespaces))
        self.fleet = Fleet(settings, RouterMetrics())
        self.serving_since: dict[str, float] = {}
        self.appeared = asyncio.Event()
        publish = self.fleet.update

        def update(table: Table, *args) -> None:
            publish(table, *args)
            now = time.perf_counter()
            serving = {r.pod for route in table.routes.values() for r in route.replicas if r.serving}
            for name in serving - self.serving_since.keys():
                self.serving_since[name] = now
            for name in self.serving_since.keys() - serving:
                del self.serving_since[name]
            self.appeared.set()
        self.fleet.update = update  # type: ignore[method-assign]

    async def start(self) -> "BenchRouter":
        self.task = asyncio.create_task(discovery.run(self.fleet, self.kube))
        await asyncio.wait_for(self.fleet.listed.wait(), 300)
        return self

    async def serving(self, name: str, timeout: float = 60.0) -> float:
        deadline = time.monotonic() + timeout
        while name not in self.serving_since:
            self.appeared.clear()
            await asyncio.wait_for(self.appeared.wait(), max(0.01, deadline - time.monotonic()))
        return self.serving_since[name]

    def load(self) -> tuple[int, int, int]:
        """(API requests, bytes from the API server, bytes to it) so far."""
        relay = self.relay
        return sum(self.requests.values()), relay.down if relay else 0, relay.up if relay else 0

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.kube.close()


async def populate(kube: KubeClient, ns: str, n: int) -> None:
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        async with sem:
            await kube.create(service(ns, i))
            await kube.create(pod(ns, i))
            await kube.merge_patch("v1", "Pod", pod(ns, i)["metadata"]["name"], pod_status(i, False), ns,
                                   subresource="status")
    try:
        await one(0)
    except Invalid as e:
        raise SystemExit(f"the API server refused the simulated pod's status ({e}); this benchmark writes the "
                         f"status of unscheduled pods") from None
    await asyncio.gather(*(one(i) for i in range(1, n)))


async def ready_to_routable(state: dict, admin: KubeClient, ns: str, mode: str, pods: list[int]) -> list[float]:
    router = await BenchRouter(state["kubeconfig"], ns, mode).start()
    out = []
    try:
        for i in pods:
            await asyncio.sleep(random.uniform(0.2, 0.2 + LIST_INTERVAL))   # a random phase of the listing
            name = pod(ns, i)["metadata"]["name"]
            sent = time.perf_counter()
            await admin.merge_patch("v1", "Pod", name, pod_status(i, True), ns, subresource="status")
            out.append(await router.serving(name) - sent)
    finally:
        await router.stop()
    return out


async def api_load(state: dict, admin: KubeClient, ns: str, mode: str, window: float, churn: float,
                   churned: list[int]) -> dict:
    server = urlparse(KubeConfig.from_file(state["kubeconfig"]).server)
    port = server.port or (443 if server.scheme == "https" else 80)
    relays = [await ByteRelay(server.hostname or "127.0.0.1", port).start() for _ in range(2)]
    routers = [BenchRouter(state["kubeconfig"], ns, mode, relay) for relay in relays]
    started = time.perf_counter()
    for r in routers:
        await r.start()
    synced = time.perf_counter() - started
    first = [r.load() for r in routers]

    async def flip() -> None:
        ready = {i: False for i in churned}
        k = 0
        while True:
            i = churned[k % len(churned)]
            ready[i] = not ready[i]
            await admin.merge_patch("v1", "Pod", pod(ns, i)["metadata"]["name"], pod_status(i, ready[i]), ns,
                                    subresource="status")
            k += 1
            await asyncio.sleep(1.0 / churn)
    flipping = asyncio.create_task(flip()) if churn > 0 else None
    await asyncio.sleep(window)
    last = [r.load() for r in routers]
    if flipping:
        flipping.cancel()
        await asyncio.gather(flipping, return_exceptions=True)
    by_kind: collections.Counter = collections.Counter()
    for r in routers:
        by_kind.update(r.requests)
        await r.stop()
    for relay in relays:
        await relay.close()
    req, down, up = (sum(b[j] - a[j] for a, b in zip(first, last)) for j in range(3))
    return {"mode": mode, "window_s": window, "requests_per_s": req / window, "down_bytes_per_s": down / window,
            "up_bytes_per_s": up / window, "first_sync_s": synced,
            "first_sync_requests": sum(f[0] for f in first), "first_sync_down_bytes": sum(f[1] for f in first),
            "requests_by_kind": {f"{v} {r}": n for (v, r), n in by_kind.items()}}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "∞ (none with watch)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="InferenceServices, one simulated engine pod each")
    p.add_argument("--samples", type=int, default=20, help="pods turned Ready per discovery mode")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds the samples are split over")
    p.add_argument("--window", type=float, default=60.0, help="seconds the API load of two routers is counted")
    p.add_argument("--churn", type=float, default=1.0, help="pod readiness changes a second during the window")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    churned_count = 10
    if args.n < 2 * args.samples + churned_count:
        p.error(f"--n must be at least 2 x --samples + {churned_count}")
    latency, load = asyncio.run(measure(args, churned_count))
    report(args, latency, load)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"n": args.n, "latency_s": latency, "load": load}, indent=2))


async def measure(args: argparse.Namespace, churned_count: int) -> tuple[dict[str, list[float]], dict[str, dict]]:
    state = await asyncio.to_thread(ensure_cluster)
    admin = client(state)
    ns = await fresh_namespace(admin, "bench-router-discovery")
    try:
        started = time.monotonic()
        await populate(admin, ns, args.n)
        print(f"created {args.n} InferenceServices and engine pods in {time.monotonic() - started:.0f} s", flush=True)

        fresh = iter(range(args.n))
        latency: dict[str, list[float]] = {m: [] for m in MODES}
        load: dict[str, dict] = {}
        per_round = max(1, args.samples // args.rounds)
        for rnd in range(args.rounds):
            for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
                pods = [next(fresh) for _ in range(per_round)]
                latency[mode] += await ready_to_routable(state, admin, ns, mode, pods)
                print(f"round {rnd + 1} {mode}: done", flush=True)
        churned = [next(fresh) for _ in range(churned_count)]
        for mode in MODES:
            load[mode] = await api_load(state, admin, ns, mode, args.window, args.churn, churned)
            print(f"load {mode}: done", flush=True)
    finally:
        await admin.delete("v1", "Namespace", ns)
        await admin.close()
    return latency, load


def report(args: argparse.Namespace, latency: dict[str, list[float]], load: dict[str, dict]) -> None:
    print(f"\nN={args.n} InferenceServices, one engine pod each; list every {LIST_INTERVAL:g} s; rebuilds coalesced "
          f"to {discovery.COALESCE_SECONDS * 1000:.0f} ms with watch\n")
    print("| discovery | Ready → in the routes p50 | p90 | worst | samples |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        v = latency[mode]
        print(f"| {mode} | {1000 * statistics.median(v):.0f} ms | {1000 * pct(v, 0.9):.0f} ms | "
              f"{1000 * max(v):.0f} ms | {len(v)} |")
    w, li = latency[discovery.Discovery.WATCH], latency[discovery.Discovery.LIST]
    print(f"\nlist / watch, time to routable: p50 {ratio(statistics.median(li), statistics.median(w))}, "
          f"p90 {ratio(pct(li, 0.9), pct(w, 0.9))}")
    print(f"\nAPI load of 2 routers over {args.window:g} s, {args.churn:g} pod readiness changes/s:\n")
    print("| discovery | API requests/s | KiB/s from the API server | KiB/s to it | first sync (both) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        r = load[mode]
        print(f"| {mode} | {r['requests_per_s']:.2f} | {r['down_bytes_per_s'] / 1024:.1f} | "
              f"{r['up_bytes_per_s'] / 1024:.1f} | {r['first_sync_s']:.1f} s, {r['first_sync_requests']} requests, "
              f"{r['first_sync_down_bytes'] / 2**20:.1f} MiB |")
    lw, ll = load[discovery.Discovery.WATCH], load[discovery.Discovery.LIST]
    print(f"\nlist / watch: requests/s {ratio(ll['requests_per_s'], lw['requests_per_s'])}, "
          f"bytes/s from the API server {ratio(ll['down_bytes_per_s'], lw['down_bytes_per_s'])}")
    for mode in MODES:
        print(f"{mode}: requests in the window and the first sync by kind: " +
              ", ".join(f"{k} {n}" for k, n in sorted(load[mode]["requests_by_kind"].items())))


if __name__ == "__main__":
    main()
