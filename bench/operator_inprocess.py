"""The operator's own share of reconciling N InferenceServices: its CPU, API requests and memory,
measured without a cluster.

bench/operator_scale.py times the whole system (API server, etcd, controllers and the operator on
2 cores). Here the operator's real code runs in this process and an in-memory API server
(``tests/support/fake_kube.py``) in a child process, so this process's CPU and peak RSS are the
operator's alone:

- the operator's real objects: ``OperatorRuntime`` (its ``Controller``, the fleet loop's state,
  the trigger queue) and its real ``KubeClient`` over HTTP (aiohttp, no TLS) to the fake server;
  the kopf handlers of ``handlers.py`` are called with each watch event as kopf would call them
  (kopf's own machinery is not run: its share here is reading and decoding the events' JSON,
  reported on its own line);
- the fake server stores objects as the API server does (``metadata.managedFields``,
  creationTimestamp; a no-op apply writes nothing) and answers a LIST by scanning the namespace's
  objects of that kind, as the API server's watch cache does for a label selector;
- between the operator's writes, the cluster's: the Deployment controller's status, one pod per
  replica (the first 32 placed on 4 GPU nodes of 8, like the dev cluster's simulated fleet, and
  become ready; the rest Unschedulable), the disruption controller's budget status. Every change
  reaches the handlers as a watch event, the echoes of the operator's own writes included.

Phases, each with the operator's CPU per service, its API requests per service by verb and
resource, and how far it raised the process's RSS: ``create`` (the services' ADDED events),
``apply`` (the reconcile each asks for: children applied, status written), ``echo`` (the watch
events of those writes), ``rollout`` and ``ready`` (the cluster's two waves and the reconciles they
cause), ``reapply`` and ``refresh`` (one more reconcile of every service with nothing changed,
children applied or status only: a resync, a takeover), ``audit`` (one cluster audit pass) and
``fleet pass`` (one scan of the fleet loop for services due). Then what the operator keeps: its
structures' sizes at N, and (``--memory-n``, slow under tracemalloc) the live allocations by
file:line, their growth a service against N=10.

``--kopf``: the whole operator as ``gpufleet run --namespace bench`` runs it, kopf included (its
watches against the fake server's WATCH, the handlers, the trigger queue with its debounce, the fleet
loops, the audits): the process's CPU and peak RSS from creation to Ready, through the rollout and
the ready wave, and 10 s idle; the requests of the operator's client and of kopf's apart.

    .venv/bin/python bench/operator_inprocess.py [--n 1000] [--memory-n 50] [--profile] [--kopf] [--json out.json]

N=10 and N run as separate processes of the same invocation (each its own peak RSS).
``--profile``: cProfile of the operator's phases at ``--profile-n`` (default N), top 30 by
cumulative and by own time.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from _services import service  # noqa: E402

NAMESPACE = "bench"
STAMP = "2026-12-01T00:00:00Z"
GPU_NODES, GPUS_PER_NODE = 4, 8   # the dev cluster's simulated fleet (devcluster.cluster.FleetSpec)
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
UNSCHEDULABLE = (f"0/{GPU_NODES + 1} nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
                 f"{GPU_NODES} Insufficient nvidia.com/gpu. preemption: 0/{GPU_NODES + 1} nodes are available: "
                 f"{GPU_NODES} No preemption victims found for incoming pod.")
EVENTS_PER_READ = 50   # watch events fetched at a time (kopf reads its streams line by line)
TICK = os.sysconf("SC_CLK_TCK")

# What discovery answers (api version -> (plural, kind, namespaced)); PodMonitor is not served.
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [("pods", "Pod", True), ("nodes", "Node", False), ("services", "Service", True),
           ("configmaps", "ConfigMap", True), ("events", "Event", True),
           ("persistentvolumeclaims", "PersistentVolumeClaim", True), ("namespaces", "Namespace", False)],
    "apps/v1": [("deployments", "Deployment", True), ("replicasets", "ReplicaSet", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "serving.gpufleet.dev/v1alpha1": [("inferenceservices", "InferenceService", True),
                                      ("inferenceadapters", "InferenceAdapter", True)],
}


# --- the fake API server (its own process) -------------------------------------------------------

def fields_v1(value: Any) -> Any:
    """The shape of ``metadata.managedFields[].fieldsV1`` the API server records for ``value``."""
    if isinstance(value, dict):
        return {f"f:{k}": fields_v1(v) for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, item in enumerate(value):
            key = next((f'k:{{"{k}":{json.dumps(item[k])}}}' for k in ("name", "type", "containerPort", "uid")
                        if k in item), f"i:{i}")
            out[key] = {".": {}, **fields_v1(item)}
        return out
    return {}


def managed_fields(obj: dict, manager: str) -> list[dict]:
    meta = obj["metadata"]
    owned = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "status")}
    owned["metadata"] = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
    version = obj.get("apiVersion", "v1")
    entries = [{"manager": manager, "operation": "Apply", "apiVersion": version, "time": STAMP,
                "fieldsType": "FieldsV1", "fieldsV1": fields_v1(owned)}]
    if obj.get("status"):
        entries.append({"manager": "kube-controller-manager", "operation": "Update", "apiVersion": version,
                        "time": STAMP, "fieldsType": "FieldsV1", "fieldsV1": fields_v1({"status": obj["status"]}),
                        "subresource": "status"})
    return entries


def _unversioned(obj: dict) -> dict:
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("resourceVersion", "managedFields")}
    return {**{k: v for k, v in obj.items() if k != "status" or v}, "metadata": meta}


def _status(code: int, reason: str, message: str, plural: str = "", name: str = "") -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message, "details": {"name": name, "kind": plural}}


def _cond(type_: str, status: str, reason: str, message: str = "") -> dict:
    out = {"type": type_, "status": status, "lastTransitionTime": STAMP}
    if reason:
        out["reason"] = reason
    if message:
        out["message"] = message
    return out


def gpu_nodes() -> list[dict]:
    nodes = [{"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": f"gpu-{i}", "namespace": "", "labels": {"gpufleet.dev/node-pool": "gpu",
                                                       "nvidia.com/gpu.product": GPU_PRODUCT,
                                                       "nvidia.com/gpu.count": str(GPUS_PER_NODE)}},
        "spec": {}, "status": {"capacity": {"nvidia.com/gpu": str(GPUS_PER_NODE), "cpu": "64"},
                               "allocatable": {"nvidia.com/gpu": str(GPUS_PER_NODE), "cpu": "64"}}}
        for i in range(GPU_NODES)]
    nodes.append({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-0", "namespace": "", "labels": {}},
                  "spec": {}, "status": {"capacity": {"cpu": "16"}, "allocatable": {"cpu": "16"}}})
    return nodes


SERVICE_LABEL = "gpufleet.dev/service"


def _service_of(key: tuple, obj: dict) -> tuple:
    return key[0], key[1], (obj["metadata"].get("labels") or {}).get(SERVICE_LABEL)


def _fields_match(obj: dict, selector: str | None) -> bool:
    """A field selector of ``path=value`` and ``path!=value`` terms (spec.nodeName, status.phase)."""
    for term in (selector or "").split(","):
        if not term:
            continue
        negated = "!=" in term
        path, value = term.split("!=" if negated else "=", 1)
        found: Any = obj
        for part in path.split("."):
            found = (found or {}).get(part) if isinstance(found, dict) else None
        if ((found or "") == value) == negated:
            return False
    return True


def fake_server():
    """FakeKube storing objects as the API server does, indexed by kind; the watch history as JSON lines."""
    from tests.support.fake_kube import FakeKube, _matches

    class ApiServer(FakeKube):
        def __init__(self) -> None:
            super().__init__()
            self.by_kind: dict[str, dict] = collections.defaultdict(dict)
            # The objects of a service (its label): LISTs find theirs at once here, and count as
            # ``scanned`` what the API server's watch cache examines for a label selector (every
            # object of the kind in the namespace).
            self.by_service: dict[tuple, dict] = collections.defaultdict(dict)
            self.scanned = 0
            # Every change as its watch event: (resourceVersion, kind, namespace, labels, JSON line).
            self.changes: list[tuple[int, str, str, dict, str]] = []
            self.delivered = 0   # how many of them the bench handed to the handlers (phases without kopf)
            self.changed = asyncio.Event()

        def _store(self, key, obj):
            meta = obj["metadata"]
            old = self.objects.get(key)
            if old is not None and _unversioned(old) == _unversioned(obj):
                meta["resourceVersion"] = old["metadata"]["resourceVersion"]  # a no-op write: no event
                return
            meta.setdefault("creationTimestamp", STAMP)
            meta["managedFields"] = managed_fields(obj, "kube-controller-manager" if key[0] == "Pod" else "gpufleet")
            super()._store(key, obj)
            self.by_kind[key[0]][key] = obj
            self.by_service[_service_of(key, obj)][key] = obj

        def _changed(self, kind, obj):  # the watch's JSON line
            meta = obj["metadata"]
            self.changes.append((int(meta["resourceVersion"]), obj["kind"], meta.get("namespace", ""),
                                 dict(meta.get("labels") or {}), json.dumps({"type": kind, "object": obj})))
            self.changed.set()

        async def _record(self, verb, key, body):  # no log of every write
            pass

        async def delete(self, api_version, kind, name, namespace=None, **_):
            key = (kind, namespace or "", name)
            obj = self.by_kind[kind].pop(key, None)
            if obj is not None:
                self.by_service[_service_of(key, obj)].pop(key, None)
            return await super().delete(api_version, kind, name, namespace)

        def listed(self, kind: str, namespace: str | None, selector: str | None,
                   fields: str | None = None) -> list[dict]:
            """A LIST's items, as the API server would find them."""
            terms = dict(term.split("=", 1) for term in selector.split(",")) if selector else {}
            service = terms.get(SERVICE_LABEL)
            if service is not None and namespace is not None:
                candidates = self.by_service[(kind, namespace, service)]
                self.scanned += sum(1 for _, ns, _ in self.by_kind[kind] if ns == namespace)
            else:
                candidates = self.by_kind[kind]
                self.scanned += len(candidates)
            return [o for (_, ns, _), o in sorted(candidates.items())
                    if namespace in (None, ns) and _matches(o, selector) and _fields_match(o, fields)]

        def status(self, obj: dict, status: dict) -> None:
            """What a controller's status update stores."""
            meta = obj["metadata"]
            key = (obj["kind"], meta["namespace"], meta["name"])
            self._store(key, {**obj, "status": {k: v for k, v in status.items() if v is not None},
                              "metadata": {**meta, "resourceVersion": self._next_rv()}})

    return ApiServer()


class Cluster:
    """The controllers and kubelets: what they write after the operator's applies."""

    def __init__(self, kube):
        self.kube = kube
        self.placed = 0

    def objects(self, kind: str) -> list[dict]:
        return [o for _, o in sorted(self.kube.by_kind[kind].items())]

    def rollout(self) -> None:
        """Deployments start rolling out: a pod per replica, placed while GPUs are free (else
        Unschedulable); budgets count no healthy pod yet."""
        for dep in self.objects("Deployment"):
            meta, replicas = dep["metadata"], dep["spec"]["replicas"]
            self.kube.status(dep, {"observedGeneration": meta["generation"], "replicas": replicas,
                                   "updatedReplicas": replicas, "unavailableReplicas": replicas, "conditions": [
                                       _cond("Progressing", "True", "NewReplicaSetCreated"),
                                       _cond("Available", "False", "MinimumReplicasUnavailable")]})
            template = dep["spec"]["template"]
            for r in range(replicas):
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
                    "name": f"{meta['name']}-6d4cf56db9-{r:05x}", "namespace": meta["namespace"],
                    "labels": {**template["metadata"]["labels"], "pod-template-hash": "6d4cf56db9"},
                    "annotations": dict(template["metadata"].get("annotations") or {}),
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True,
                                         "name": f"{meta['name']}-6d4cf56db9", "uid": f"rs-{meta['uid']}"}]},
                    "spec": json.loads(json.dumps(template["spec"]))}
                if self.placed < GPU_NODES * GPUS_PER_NODE:
                    pod["spec"]["nodeName"] = f"gpu-{self.placed // GPUS_PER_NODE}"
                    pod["status"] = {"phase": "Pending", "qosClass": "Burstable",
                                     "conditions": [_cond("PodScheduled", "True", "")]}
                    self.placed += 1
                else:
                    pod["status"] = {"phase": "Pending", "qosClass": "Burstable", "conditions": [
                        _cond("PodScheduled", "False", "Unschedulable", UNSCHEDULABLE)]}
                self.kube.put(pod)
        for pdb in self.objects("PodDisruptionBudget"):
            self.kube.status(pdb, {"observedGeneration": pdb["metadata"]["generation"], "currentHealthy": 0,
                                   "desiredHealthy": 1, "disruptionsAllowed": 0, "expectedPods": 1,
                                   "conditions": [_cond("DisruptionAllowed", "False", "InsufficientPods")]})

    def ready(self) -> None:
        """The placed pods start and become ready; their Deployments and budgets say so."""
        ready_services = set()
        for pod in self.objects("Pod"):
            node = pod["spec"].get("nodeName")
            if not node:
                continue
            index = int(node.split("-")[1])
            self.kube.status(pod, {
                "phase": "Running", "podIP": f"10.244.{index}.{len(ready_services) + 2}",
                "hostIP": f"172.18.0.{index + 2}", "startTime": STAMP, "qosClass": "Burstable",
                "conditions": [_cond(t, "True", "") for t in ("Initialized", "Ready", "ContainersReady",
                                                                "PodScheduled")],
                "containerStatuses": [{"name": c["name"], "ready": True, "restartCount": 0, "started": True,
                                       "image": c.get("image"), "imageID": f"docker://{c.get('image')}",
                                       "state": {"running": {"startedAt": STAMP}}}
                                      for c in pod["spec"].get("containers") or []]})
            ready_services.add(pod["metadata"]["labels"]["gpufleet.dev/service"])
        for dep in self.objects("Deployment"):
            if dep["metadata"]["labels"].get("gpufleet.dev/service") in ready_services:
                self.kube.status(dep, {**dep["status"], "readyReplicas": 1, "availableReplicas": 1,
                                       "unavailableReplicas": None, "conditions": [
                                           _cond("Progressing", "True", "NewReplicaSetAvailable"),
                                           _cond("Available", "True", "MinimumReplicasAvailable")]})
        for pdb in self.objects("PodDisruptionBudget"):
            if pdb["metadata"]["labels"].get("gpufleet.dev/service") in ready_services:
                self.kube.status(pdb, {**pdb["status"], "currentHealthy": 1})


def target(path: str) -> tuple[str, str | None, str, str | None, str | None]:
    """(api version, namespace, plural, name, subresource) of a resource path; plural "" for the
    version's discovery."""
    parts = [p for p in path.split("/") if p]
    api_version = "v1" if parts[0] == "api" else "/".join(parts[1:3])
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    namespace = None
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    rest += [""] * (3 - len(rest))
    return api_version, namespace, rest[0], rest[1] or None, rest[2] or None


def kind_of(api_version: str, plural: str) -> str:
    return next(k for p, k, _ in RESOURCES[api_version] if p == plural)


async def api(kube, request) -> tuple[int, dict]:
    """One API request, answered from ``kube`` as the API server would."""
    from gpufleet_kit.kube.errors import ApiError

    method, parts = request.method, [p for p in request.path.split("/") if p]
    if parts == ["version"]:
        return 200, {"major": "1", "minor": "34", "gitVersion": "v1.34.4"}
    if parts == ["api"]:
        return 200, {"kind": "APIVersions", "versions": ["v1"]}
    if parts == ["apis"]:
        groups = sorted({v.split("/")[0] for v in RESOURCES if "/" in v})
        return 200, {"kind": "APIGroupList", "groups": [
            {"name": g, "versions": [{"groupVersion": v, "version": v.split("/")[1]} for v in RESOURCES
                                     if v.startswith(f"{g}/")],
             "preferredVersion": {"groupVersion": next(v for v in RESOURCES if v.startswith(f"{g}/")),
                                  "version": next(v for v in RESOURCES if v.startswith(f"{g}/")).split("/")[1]}}
            for g in groups]}
    api_version, namespace, plural, name, sub = target(request.path)
    served = RESOURCES.get(api_version)
    if served is None:
        return 404, _status(404, "NotFound", "the server could not find the requested resource")
    if not plural:
        verbs = ["create", "delete", "get", "list", "patch", "update", "watch"]
        return 200, {"kind": "APIResourceList", "groupVersion": api_version, "resources": [
            *({"name": plural, "singularName": kind.lower(), "kind": kind, "namespaced": namespaced, "verbs": verbs}
              for plural, kind, namespaced in served),
            *({"name": f"{plural}/status", "singularName": "", "kind": kind, "namespaced": namespaced,
               "verbs": ["get", "patch"]} for plural, kind, namespaced in served)]}
    kind = next(k for p, k, _ in served if p == plural)
    body = await request.json() if request.can_read_body else None
    try:
        if method == "GET" and name:
            obj = kube.objects.get((kind, namespace or "", name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{plural} "{name}" not found', plural, name)
            return 200, obj
        if method == "GET":  # the watch cache: every object of the kind in the namespace, filtered
            items = kube.listed(kind, namespace, request.query.get("labelSelector"), request.query.get("fieldSelector"))
            return 200, {"apiVersion": api_version, "kind": f"{kind}List",
                         "metadata": {"resourceVersion": str(kube._rv)}, "items": items}
        if method == "POST" and kind == "Event":
            kube.events.append(body["reason"])  # the reason, not the Event
            return 201, {**body, "metadata": {**body["metadata"], "name": f"{body['metadata']['generateName']}x"}}
        if method == "PATCH" and request.content_type == "application/apply-patch+yaml":
            return 200, await kube.apply(body)
        if method == "PATCH":
            return 200, await kube.merge_patch(api_version, kind, name, body, namespace, subresource=sub)
        if method == "DELETE":
            if not await kube.delete(api_version, kind, name, namespace):
                return 404, _status(404, "NotFound", f'{plural} "{name}" not found', plural, name)
            return 200, _status(200, "Success", "")
    except ApiError as e:
        return e.status, _status(e.status, e.reason, e.message, plural, name or "")
    return 405, _status(405, "MethodNotAllowed", f"{method} {request.path}")


def serve() -> None:
    """The fake API server, and the bench's controls of it under /bench/; prints its port."""
    from aiohttp import web

    kube = fake_server()
    cluster = Cluster(kube)

    wakers: set[asyncio.Event] = set()
    requests: collections.Counter = collections.Counter()   # by client (kopf, the operator's), method, resource

    async def wake_watchers() -> None:
        while True:
            await kube.changed.wait()
            kube.changed.clear()
            for event in wakers:
                event.set()

    async def watch(request: web.Request) -> web.StreamResponse:
        """A WATCH from ``resourceVersion``: each later change of the kind (namespace, labels) as a line,
        until ``timeoutSeconds`` pass; a BOOKMARK at the end when asked."""
        api_version, namespace, plural, _, _ = target(request.path)
        kind = kind_of(api_version, plural)
        terms = [t.split("=", 1) for t in (request.query.get("labelSelector") or "").split(",") if t]
        since = int(request.query.get("resourceVersion") or 0)
        deadline = asyncio.get_running_loop().time() + float(request.query.get("timeoutSeconds", 60))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        position = bisect.bisect_right(kube.changes, since, key=lambda change: change[0])
        wake = asyncio.Event()
        wakers.add(wake)
        try:
            while True:
                wake.clear()
                while position < len(kube.changes):
                    _, k, ns, labels, line = kube.changes[position]
                    position += 1
                    if k == kind and namespace in (None, ns) and all(labels.get(a) == b for a, b in terms):
                        await response.write(line.encode() + b"\n")
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    await asyncio.wait_for(wake.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            if request.query.get("allowWatchBookmarks") == "true":
                await response.write(json.dumps({"type": "BOOKMARK", "object": {
                    "kind": kind, "apiVersion": api_version,
                    "metadata": {"resourceVersion": str(kube._rv)}}}).encode() + b"\n")
        finally:
            wakers.discard(wake)
        return response

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/bench/"):
            return await control(request)
        agent = "kopf" if "kopf" in request.headers.get("User-Agent", "") else "operator"
        requests[f"{agent} {request.method} {target(request.path)[2] or '(discovery)'}"] += 1
        if request.method == "GET" and request.query.get("watch") in ("true", "1"):
            return await watch(request)
        status, doc = await api(kube, request)
        return web.Response(status=status, text=json.dumps(doc), content_type="application/json")

    async def control(request: web.Request) -> web.StreamResponse:
        what = request.path.removeprefix("/bench/")
        if what == "events":  # the next watch events, one JSON line each
            limit = int(request.query.get("limit", EVENTS_PER_READ))
            lines = [line for *_, line in kube.changes[kube.delivered:kube.delivered + limit]]
            kube.delivered += len(lines)
            return web.Response(text="\n".join(lines))
        if what == "nodes":   # and the namespace (kopf watches only namespaces that exist)
            kube.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "namespace": ""}})
            for node in gpu_nodes():
                kube.put(node)
        elif what == "services":
            for i in range(int(request.query["n"])):
                obj = service(i)
                obj["metadata"]["namespace"] = NAMESPACE
                kube.put(obj)
        elif what == "rollout":
            cluster.rollout()
        elif what == "ready":
            cluster.ready()
        services = kube.by_kind["InferenceService"].values()
        ready = [next((c for c in (o.get("status") or {}).get("conditions", []) if c["type"] == "Ready"), {})
                 for o in services]
        return web.json_response({
            "ready_reasons": dict(collections.Counter(c.get("reason") for c in ready if c)),
            "rolling": sum(1 for o in services if (o.get("status") or {}).get("replicas")),
            "requests": dict(requests),
            "objects": len(kube.objects), "events": dict(collections.Counter(kube.events)), "scanned": kube.scanned,
            "reconciled": sum(1 for o in services if (o.get("status") or {}).get("observedGeneration") == 1
                              and any(c["type"] == "Ready" for c in o["status"].get("conditions", [])))})

    async def main() -> None:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await wake_watchers()
    asyncio.run(main())


# --- the operator (this process) ---------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Operator:
    """The operator's runtime against the fake server at ``url``, fed its watch events."""

    def __init__(self, url: str, kubeconfig: Path):
        import aiohttp
        import kopf

        from gpufleet.settings import OperatorSettings
        from gpufleet.wiring.runtime import OperatorRuntime
        from gpufleet_kit.kube.config import KubeConfig

        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "bench",
            "clusters": [{"name": "bench", "cluster": {"server": url}}],
            "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench", "namespace": NAMESPACE}}],
            "users": [{"name": "bench", "user": {"token": "t"}}]}))
        self.url = url
        self.rt = OperatorRuntime(KubeConfig.from_file(str(kubeconfig)),
                                  OperatorSettings(namespaces=(NAMESPACE,), metrics_port=None))
        self.memo = kopf.Memo(runtime=self.rt)
        self.bench = aiohttp.ClientSession()   # the bench's controls: not the operator's requests
        self.watch_cpu = 0.0   # kopf's share we can count: reading and decoding each watch event's JSON
        self.failures = 0

    def requests(self) -> collections.Counter:
        """The operator's API requests so far by "verb resource" (its own counter)."""
        out: collections.Counter = collections.Counter()
        for family in self.rt.metrics.api_requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[f"{sample.labels['verb']} {sample.labels['resource'] or '(discovery)'}"] += int(sample.value)
        return out

    async def control(self, what: str, **query: Any) -> dict:
        async with self.bench.post(f"{self.url}/bench/{what}", params={k: str(v) for k, v in query.items()}) as r:
            return await r.json()

    async def deliver(self) -> int:
        """The watch events of every change since the last call, each to the handler kopf would call
        (with kopf's filters); how many."""
        from gpufleet.manifests import names
        from gpufleet.wiring import handlers

        children = {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"}
        delivered = 0
        while True:
            started = time.process_time()
            async with self.bench.get(f"{self.url}/bench/events", params={"limit": str(EVENTS_PER_READ)}) as r:
                text = await r.text()
            events = [json.loads(line) for line in text.split("\n") if line]
            self.watch_cpu += time.process_time() - started
            if not events:
                return delivered
            for event in events:
                type_, body = event["type"], event["object"]
                meta = body["metadata"]
                kind, labels = body["kind"], meta.get("labels") or {}
                if kind == "InferenceService":
                    await handlers.service_event(type=type_, body=body, namespace=meta["namespace"],
                                                 name=meta["name"], memo=self.memo)
                elif kind in children and labels.get(names.LABEL_MANAGED_BY) == names.MANAGER:
                    await handlers.child_changed(type=type_, body=body, namespace=meta["namespace"], memo=self.memo)
                elif kind == "Pod" and labels.get(names.LABEL_NAME) == names.ENGINE_APP:
                    await handlers.engine_pod_changed(type=type_, body=body, name=meta["name"],
                                                      namespace=meta["namespace"], memo=self.memo)
                elif kind == "Node":
                    await handlers.node_changed(type=type_, body=body, name=meta["name"], memo=self.memo)
            delivered += len(events)

    async def reconcile_triggered(self) -> collections.Counter:
        """What ``run_triggered`` does with one burst: every key asked for, TRIGGERED_CONCURRENCY at once."""
        from gpufleet.wiring.runtime import TRIGGERED_CONCURRENCY
        keys = self.rt.drain_triggered()
        sem = asyncio.Semaphore(TRIGGERED_CONCURRENCY)

        async def one(ns: str, name: str, apply: bool) -> None:
            async with sem:
                await self.rt._reconcile(ns, name, apply)
        await asyncio.gather(*(one(ns, name, apply) for (ns, name), apply in sorted(keys.items())))
        self.failures += len(self.rt._failures)
        return collections.Counter("apply" if apply else "status" for apply in keys.values())

    async def settle(self, row: dict) -> None:
        """Deliver the watch events of what was written and reconcile what they ask for, until quiet."""
        for _ in range(5):
            delivered = await self.deliver()
            row["events"] += delivered
            if not delivered and not self.rt._pending:
                return
            row["reconciles"].update(await self.reconcile_triggered())

    async def close(self) -> None:
        await self.bench.close()
        await self.rt.kube.close()


class Phases:
    """Per phase: the operator's CPU (this process's, kopf's counted share apart), its API requests,
    the reconciles of each kind, the watch events handled, the server's CPU and the RSS it added."""

    def __init__(self, op: Operator, server_pid: int):
        self.op = op
        self.server_pid = server_pid
        self.rows: list[dict] = []

    @contextlib.asynccontextmanager
    async def phase(self, name: str):
        op = self.op
        row: dict = {"phase": name, "reconciles": collections.Counter(), "events": 0}
        scanned = (await op.control("stats"))["scanned"]
        gc.collect()
        before = rss_mib()
        reset_peak_rss()
        cpu, watch, srv, req = time.process_time(), op.watch_cpu, cpu_seconds(self.server_pid), op.requests()
        yield row
        row["scanned"] = (await op.control("stats"))["scanned"] - scanned
        row["watch_cpu"] = op.watch_cpu - watch
        row["cpu"] = time.process_time() - cpu - row["watch_cpu"]
        row["server_cpu"] = cpu_seconds(self.server_pid) - srv
        row["requests"] = dict(op.requests() - req)
        row["reconciles"] = dict(row["reconciles"])
        row["peak_rss_rise_mib"] = peak_rss_mib() - before
        self.rows.append(row)


@contextlib.contextmanager
def api_server():
    proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait()


async def scenario(n: int, url: str, server_pid: int, profile: cProfile.Profile | None = None) -> dict:
    from gpufleet.fleet.cluster_audit import ClusterAuditor

    op = Operator(url, Path(tempfile.mkdtemp()) / "config")
    rt = op.rt
    phases = Phases(op, server_pid)
    await op.control("nodes")
    await op.deliver()   # the node watch's listing at start
    if profile is not None:
        profile.enable()
    async with phases.phase("create") as row:
        await op.control("services", n=n)
        row["events"] += await op.deliver()
    async with phases.phase("apply") as row:
        row["reconciles"].update(await op.reconcile_triggered())
    async with phases.phase("echo") as row:
        await op.settle(row)
    async with phases.phase("rollout") as row:
        await op.control("rollout")
        await op.settle(row)
    async with phases.phase("ready") as row:
        await op.control("ready")
        await op.settle(row)
    async with phases.phase("reapply") as row:
        for ns, name in sorted(rt.known):
            rt.trigger(ns, name, apply=True)
        await op.settle(row)
    async with phases.phase("refresh") as row:
        for ns, name in sorted(rt.known):
            rt.trigger(ns, name, apply=False)
        await op.settle(row)
    async with phases.phase("audit") as row:
        auditor = ClusterAuditor(objects=rt.kube, events=rt.kube, status=rt.controller, metrics=rt.metrics,
                                 watched=rt.known)
        await auditor.run_once()
        await op.settle(row)
    async with phases.phase("fleet pass") as row:
        assert rt.fleet is not None
        row["due"] = len(rt.fleet.due_now(time.monotonic()))
    if profile is not None:
        profile.disable()
    stats = await op.control("stats")
    await op.close()
    return {"n": n, "phases": phases.rows, "reconciled": stats["reconciled"], "failures": op.failures,
            "stored_objects": stats["objects"], "event_reasons": stats["events"], "op": op}


async def kopf_scenario(n: int, url: str, server_pid: int, profile: cProfile.Profile | None = None) -> dict:
    """The whole operator as ``gpufleet run --namespace bench`` runs it: kopf's watches and the handlers,
    the trigger queue, the fleet loops and audits; the phases end when status shows what they caused."""
    import kopf

    from gpufleet.wiring import handlers  # noqa: F401  (registers the handlers)

    op = Operator(url, Path(tempfile.mkdtemp()) / "config")
    stop = asyncio.Event()
    await op.control("nodes")
    stuck = max(0, n - GPU_NODES * GPUS_PER_NODE)
    rows: list[dict] = []

    async def phase(name: str, control: str | None, done, **query: Any) -> None:
        before = await op.control("stats")
        gc.collect()
        rss, cpu, srv, req = rss_mib(), time.process_time(), cpu_seconds(server_pid), op.requests()
        reset_peak_rss()
        started = time.monotonic()
        if control:
            await op.control(control, **query)
        while not done(stats := await op.control("stats")):
            if time.monotonic() - started > 600:
                raise SystemExit(f"{name}: not done after 600 s: {stats['ready_reasons']}")
            await asyncio.sleep(0.1)
        rows.append({"phase": name, "seconds": time.monotonic() - started, "cpu": time.process_time() - cpu,
                     "server_cpu": cpu_seconds(server_pid) - srv, "requests": dict(op.requests() - req),
                     "kopf_requests": {k.removeprefix("kopf "): v - before["requests"].get(k, 0)
                                       for k, v in stats["requests"].items()
                                       if k.startswith("kopf ") and v > before["requests"].get(k, 0)},
                     "peak_rss_rise_mib": peak_rss_mib() - rss})

    def reasons(stats: dict) -> collections.Counter:
        return collections.Counter(stats["ready_reasons"])

    if profile is not None:
        profile.enable()
    running = asyncio.create_task(kopf.operator(clusterwide=False, namespaces=[NAMESPACE], standalone=True,
                                                memo=op.memo, stop_flag=stop))
    try:
        await phase("start", None, lambda stats: bool(op.rt._tasks))
        await phase("create to Ready", "services", lambda stats: stats["reconciled"] == n, n=n)
        await phase("rollout", "rollout", lambda stats: reasons(stats)["Unschedulable"] == stuck
                    and stats["rolling"] == n)
        await phase("ready", "ready", lambda stats: reasons(stats)["AllReplicasReady"] == n - stuck)
        idle_until = time.monotonic() + STEADY_SECONDS
        await phase(f"steady {STEADY_SECONDS:.0f} s", None, lambda stats: time.monotonic() >= idle_until)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        if profile is not None:
            profile.disable()
        await op.bench.close()
    return {"n": n, "phases": rows, "op": op}


STEADY_SECONDS = 10.0


# --- measurement modes (each its own process) ----------------------------------------------------

_PEAK_BEFORE_RESET = [0.0]


def peak_rss_mib() -> float:
    return _proc_status("VmHWM")


def rss_mib() -> float:
    return _proc_status("VmRSS")


def _proc_status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5), so a phase's own peak shows;
    ``process_peak_rss_mib`` keeps the process's."""
    _PEAK_BEFORE_RESET[0] = max(_PEAK_BEFORE_RESET[0], peak_rss_mib())
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def process_peak_rss_mib() -> float:
    return max(_PEAK_BEFORE_RESET[0], peak_rss_mib())


def deep_size(root: object, seen: set[int]) -> int:
    """Bytes of ``root`` and everything it reaches that ``seen`` does not hold yet (code and classes aside)."""
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)
    size, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        size += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return size


def retained(op: Operator) -> dict[str, float]:
    """MiB the operator's structures hold once every phase ran (each object counted once, in the first
    structure that reaches it)."""
    rt = op.rt
    assert rt.fleet is not None
    roots = {"fleet loop: services": rt.fleet.services, "fleet loop: pods": rt.fleet.pods,
             "fleet loop: service loops": rt.fleet._loops, "controller: applied children": rt.controller.applied,
             "controller: locks": rt.controller._locks, "controller: cordons": rt.controller.cordons,
             "metrics registry": rt.metrics.registry, "runtime (the rest)": rt}
    seen: set[int] = set()
    return {name: deep_size(root, seen) / 2**20 for name, root in roots.items()}


def import_operator() -> float:
    """What the operator process imports (``gpufleet run``); its RSS after."""
    import kopf  # noqa: F401

    from gpufleet.wiring import handlers, runtime  # noqa: F401
    return rss_mib()


def _timed(n: int, run) -> dict:
    """``run(n, url, pid)`` against the fake API server: its result, wall time and the process's RSS."""
    imported = import_operator()
    with api_server() as (url, pid):
        started = time.monotonic()
        result = asyncio.run(run(n, url, pid))
        wall = time.monotonic() - started
    return {**result, "wall": wall, "imported_rss_mib": imported, "peak_rss_mib": process_peak_rss_mib()}


def worker_time(n: int) -> dict:
    result = _timed(n, scenario)
    return {**result, "op": None, "retained_mib": retained(result["op"])}


def _where(tb: tracemalloc.Traceback) -> str:
    """An allocation's innermost frame in the operator's code (or this bench's, or neither's)."""
    for frame in reversed(list(tb)):   # tracemalloc orders the oldest first
        path = frame.filename
        for top in ("/operator/", "/engine_image/"):
            if top in path and "/gpufleet" in path:
                return f"{path.split(top, 1)[1]}:{frame.lineno}"
        if path == __file__:
            return f"bench/{Path(path).name}:{frame.lineno}"
    return f"(other) {Path(tb[-1].filename).name}:{tb[-1].lineno}"


def worker_memory(n: int) -> dict:
    import_operator()
    with api_server() as (url, pid):
        tracemalloc.start(25)
        result = asyncio.run(scenario(n, url, pid))
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
        tracemalloc.stop()
    by_line: collections.Counter = collections.Counter()
    for stat in snapshot.statistics("traceback"):
        by_line[_where(stat.traceback)] += stat.size
    del result
    return {"n": n, "total": sum(by_line.values()), "by_line": dict(by_line)}


def _profiled(n: int, run) -> dict:
    """cProfile of ``run(n, url, pid, profile)`` against the fake API server: the top 30 both ways."""
    import_operator()
    profile = cProfile.Profile()
    with api_server() as (url, pid):
        asyncio.run(run(n, url, pid, profile))
    out = {}
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).strip_dirs().sort_stats(order).print_stats(30)
        out[order] = text.getvalue()
    return {"n": n, "profile": out}


def worker_profile(n: int) -> dict:
    return _profiled(n, scenario)


def worker_kopf(n: int) -> dict:
    return {**_timed(n, kopf_scenario), "op": None}


def worker_kopf_profile(n: int) -> dict:
    return _profiled(n, kopf_scenario)


WORKERS = {"time": worker_time, "memory": worker_memory, "profile": worker_profile, "kopf": worker_kopf,
           "kopf-profile": worker_kopf_profile}


def run_worker(mode: str, n: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--n", str(n)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} N={n} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- report ----------------------------------------------------------------------------------------

def phase_row(row: dict, n: int) -> str:
    total = sum(row["requests"].values())
    requests = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(row["requests"].items(), key=lambda kv: -kv[1]))
    reconciles = ", ".join(f"{v} {k}" for k, v in sorted(row["reconciles"].items())) or "none"
    return (f"| {row['phase']} | {1000 * row['cpu'] / n:.2f} ms | {reconciles} | {row['events']} | "
            f"{total / n:.2f}{': ' + requests if requests else ''} | {row['peak_rss_rise_mib']:.0f} MiB | "
            f"{row['server_cpu']:.1f} s |")


def table_head(*columns: str) -> None:
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def cpu_per_service(r: dict) -> float:
    return sum(p["cpu"] for p in r["phases"]) / r["n"]


def report(small: dict, big: dict, memory: tuple[dict, dict] | None) -> None:
    for r in (small, big):
        n = r["n"]
        print(f"\n## N={n}: {r['reconciled']}/{n} services Ready for generation 1, {r['failures']} failed "
              f"reconciles, {r['wall']:.1f} s wall\n")
        table_head("phase", "operator CPU a service", "reconciles", "watch events", "API requests a service",
                   "RSS rise", "fake server CPU")
        for row in r["phases"]:
            print(phase_row(row, n))
        to_ready: collections.Counter = collections.Counter()
        for row in r["phases"]:
            if row["phase"] in ("create", "apply", "echo", "rollout", "ready"):
                to_ready.update(row["requests"])
        watch = sum(p["watch_cpu"] for p in r["phases"])
        print(f"\nN={n}: operator CPU {1000 * cpu_per_service(r):.2f} ms a service over every phase, besides "
              f"{1000 * watch / n:.2f} ms reading and decoding watch events (kopf's share)")
        print(f"N={n}: API requests from creation to Ready: {sum(to_ready.values()) / n:.2f} a service "
              f"({', '.join(f'{k} {v / n:.2f}' for k, v in to_ready.most_common())})")
        print(f"N={n}: peak RSS {r['peak_rss_mib']:.0f} MiB (after the imports {r['imported_rss_mib']:.0f} MiB); "
              "kept: " + ", ".join(f"{k} {v:.2f} MiB" for k, v in r["retained_mib"].items()))
    grew = big["peak_rss_mib"] - small["peak_rss_mib"]
    print(f"\nper-service operator CPU N={big['n']} vs N={small['n']}: "
          f"{cpu_per_service(big) / cpu_per_service(small):.2f}x (1.0 = linear); peak RSS "
          f"{big['peak_rss_mib']:.0f} vs {small['peak_rss_mib']:.0f} MiB "
          f"(+{1024 * grew / (big['n'] - small['n']):.0f} KiB a service)")
    if memory is not None:
        low, high = memory
        grew = {where: size - low["by_line"].get(where, 0) for where, size in high["by_line"].items()}
        per = high["n"] - low["n"]
        print(f"\n## Live allocations after every phase (tracemalloc, by the innermost frame in the operator's "
              f"code): {low['total'] / 2**20:.1f} MiB at N={low['n']}, {high['total'] / 2**20:.1f} MiB at "
              f"N={high['n']}: {(high['total'] - low['total']) / per / 1024:.1f} KiB a service\n")
        print(f"| where | KiB at N={high['n']} | growth a service |\n|---|---|---|")
        for where, size in sorted(grew.items(), key=lambda kv: -kv[1])[:25]:
            print(f"| {where} | {high['by_line'][where] / 1024:.0f} | {size / per:.0f} B |")


def report_kopf(small: dict, big: dict) -> None:
    print("\n## The whole operator (kopf's watches and handlers, trigger queue, fleet loops, audits)")
    for r in (small, big):
        n = r["n"]
        print(f"\nN={n}: {r['wall']:.1f} s wall, peak RSS {r['peak_rss_mib']:.0f} MiB (after the imports "
              f"{r['imported_rss_mib']:.0f} MiB)\n")
        table_head("phase", "wall", "process CPU a service", "operator's API requests a service", "kopf's requests",
                   "RSS rise", "fake server CPU")
        for row in r["phases"]:
            total = sum(row["requests"].values())
            kopf_requests = ", ".join(f"{k} {v}" for k, v in sorted(row["kopf_requests"].items())) or "none"
            print(f"| {row['phase']} | {row['seconds']:.1f} s | {1000 * row['cpu'] / n:.2f} ms | {total / n:.2f} | "
                  f"{kopf_requests} | {row['peak_rss_rise_mib']:.0f} MiB | {row['server_cpu']:.1f} s |")
    def until_ready(r: dict) -> float:
        return sum(p["cpu"] for p in r["phases"] if p["phase"] in ("create to Ready", "rollout", "ready")) / r["n"]
    print(f"\nprocess CPU a service from creation to ready, N={big['n']} vs N={small['n']}: "
          f"{1000 * until_ready(big):.1f} vs {1000 * until_ready(small):.1f} ms "
          f"({until_ready(big) / until_ready(small):.2f}x); peak RSS {big['peak_rss_mib']:.0f} vs "
          f"{small['peak_rss_mib']:.0f} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--baseline-n", type=int, default=10)
    p.add_argument("--memory-n", type=int, default=50,
                   help="services for the tracemalloc runs, against --baseline-n (0: none; slow: ~1 s a service)")
    p.add_argument("--profile", action="store_true", help="cProfile the operator's phases (at --profile-n)")
    p.add_argument("--profile-n", type=int, default=None)
    p.add_argument("--kopf", action="store_true",
                   help="also run the whole operator under kopf at --baseline-n and --kopf-n (default N)")
    p.add_argument("--kopf-n", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="write the raw results here")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve()
        return
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.n)))
        return
    small, big = run_worker("time", args.baseline_n), run_worker("time", args.n)
    memory = (run_worker("memory", args.baseline_n), run_worker("memory", args.memory_n)) if args.memory_n else None
    report(small, big, memory)
    whole = None
    if args.kopf:
        whole = run_worker("kopf", args.baseline_n), run_worker("kopf", args.kopf_n or args.n)
        report_kopf(*whole)
    profiled = run_worker("profile", args.profile_n or args.n) if args.profile else None
    if profiled is not None:
        for order, text in profiled["profile"].items():
            print(f"\n## cProfile at N={profiled['n']}, by {order}\n")
            print("```\n" + text.strip() + "\n```")
    if args.json:
        args.json.write_text(json.dumps({"small": small, "big": big, "memory": memory, "profile": profiled,
                                         "kopf": whole}, indent=1))


if __name__ == "__main__":
    main()
