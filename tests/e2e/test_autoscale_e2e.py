"""The whole loop with real engines: load drives KV usage over the high
watermark, the operator scales out, the new replica becomes Ready and takes
traffic; the operator is killed mid-scale-out and its successor converges;
load drops, the operator scales in after the stabilization window, and the
replica that goes drains: no error other than 429 across the run."""
import asyncio
import json
from pathlib import Path

import yaml

from gpufleet.demo.load import EndpointLoad
from gpufleet.demo.prometheus import LocalPrometheus
from gpufleet.reconcile import conditions as c
from gpufleet.devcluster.operator_process import OperatorProcess
from tests.support.waiting import wait_for

API = "serving.gpufleet.dev/v1alpha1"
# The per-service dashboard's key panels: their queries must return data.
KEY_PANELS = ("Replicas ready / desired", "KV-cache usage against the watermarks", "Time to first token",
              "Tokens per second", "Requests by outcome", "Batch fill")
DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "gpufleet-service.json"


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
    return {"apiVersion": API, "kind": "InferenceService", "metadata": {"name": "tiny"}, "spec": {
        "model": {"name": "tiny-llama", "maxModelLen": 1024},
        "engine": {"runtime": "vllm-cpu", "dtype": "float32", "maxNumSeqs": 16, "extraArgs": ["--enforce-eager"],
                   "kvCache": {"blockSize": 32, "numBlocksOverride": 64, "cpuKvCacheSpaceGiB": 1}},
        "isolation": {"mode": "Exclusive", "nodePool": "local", "tolerations": [
            {"key": "gpufleet.dev/local-engine", "operator": "Exists", "effect": "NoSchedule"}]},
        "admission": {"requestTimeoutSeconds": 60, "kvWatermarkPercent": 15},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "kvHighWatermarkPercent": 60,
                        "kvLowWatermarkPercent": 30, "scaleDownStabilizationSeconds": 15, "maxScaleUpStep": 1}}}


async def test_scale_out_restart_and_scale_in_with_real_engines(control_plane, crds_installed, engine_nodes, kube,
                                                                namespace, tmp_path):
    op = OperatorProcess(control_plane.kubeconfig, tmp_path / "operator-1.log",
                         ("--namespace", namespace, "--audit-interval-seconds", "5")).start()
    prom = LocalPrometheus(tmp_path / "prometheus", f"127.0.0.1:{op.metrics_port}").start()
    follower = asyncio.create_task(prom.follow_pods(kube))
    try:
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(tiny_service()))

        async def get():
            return await kube.get(API, "InferenceService", "tiny", namespace)

        async def ready(n):
            o = await get()
            st = o.get("status") or {}
            return o if st.get("readyReplicas") == n and \
                (c.get(st.get("conditions"), "Ready") or {}).get("status") == "True" else None
        await wait_for(lambda: ready(1), timeout=300, what="the first real engine replica Ready",
                       describe=lambda: op.log_tail(10))
        load = EndpointLoad(kube, namespace, "tiny", "tiny-llama", prompt_tokens=200, max_tokens=96)
        phase = {"clients": 8}
        stop = asyncio.Event()
        runner = asyncio.create_task(load.run(lambda _t: phase["clients"], stop, max_clients=8))

        # Load pushes KV usage over 60%: the operator decides to scale out.
        async def scaled_out():
            o = await get()
            return o if (o.get("status") or {}).get("desiredReplicas") == 2 else None
        obj = await wait_for(scaled_out, timeout=120, what="the operator to scale out",
                             describe=lambda: op.log_tail(10))
        decision = obj["status"]["lastScaling"]
        assert decision["reason"] in ("KVHighWatermark", "Shedding", "QueueDepth")
        # Kill the operator in the middle of the scale-out; a new one must converge.
        op.stop(sig_kill=True)
        op = OperatorProcess(control_plane.kubeconfig, tmp_path / "operator-2.log",
                             ("--namespace", namespace, "--audit-interval-seconds", "5"),
                             metrics_port=op.metrics_port).start()
        dep = await wait_for(lambda: _deployment_with(kube, namespace, 2), timeout=30,
                             what="the Deployment at 2 replicas after the restart")
        assert len(await kube.list("apps/v1", "Deployment", namespace)) == 1
        assert len(await kube.list("v1", "Service", namespace)) == 1
        assert len(await kube.list("v1", "ConfigMap", namespace, label_selector="app.kubernetes.io/managed-by=gpufleet")) == 1
        assert dep["metadata"]["ownerReferences"][0]["name"] == "tiny"

        await wait_for(lambda: ready(2), timeout=300, what="the second replica Ready")
        # It takes traffic.
        pods = await kube.list("v1", "Pod", namespace, label_selector="gpufleet.dev/service=tiny")
        ips = {p["status"]["podIP"] for p in pods}

        async def both_served():
            served = {r.endpoint.split("//")[1].split(":")[0] for r in load.results if r.status == 200}
            return ips <= served
        await wait_for(both_served, timeout=120, what="both replicas to answer requests")

        # Light load: KV stays under the low watermark; after the window the operator scales in
        # while a request stream still runs, and the removed replica drains it.
        phase["clients"] = 1

        async def scaled_in():
            o = await get()
            st = o.get("status") or {}
            return o if st.get("desiredReplicas") == 1 and st.get("readyReplicas") == 1 else None
        obj = await wait_for(scaled_in, timeout=180, what="the operator to scale in",
                             describe=lambda: op.log_tail(10))
        assert obj["status"]["lastScaling"]["reason"] == "KVLowWatermark"
        await wait_for(lambda: _pods_gone_to(kube, namespace, 1), timeout=120, what="the drained pod to be gone")
        stop.set()
        results = await runner
        # An on-demand fragmentation audit collects the real /audit report of the replica: on CPU it
        # says what cannot be measured instead of inventing numbers.
        control_plane.kubectl("-n", namespace, "annotate", "inferenceservice/tiny",
                              "gpufleet.dev/audit-requested=now", "--overwrite")

        async def audited():
            o = await get()
            done = "gpufleet.dev/audit-requested" not in (o["metadata"].get("annotations") or {})
            return o if done and (o.get("status") or {}).get("fragmentation") else None
        obj = await wait_for(audited, timeout=30, what="the on-demand fragmentation audit")
        frag = obj["status"]["fragmentation"]
        assert frag["verdict"] == "Unavailable" and frag.get("percent") is None
        assert "CUDA" in frag["recommendation"] or "cpu" in frag["recommendation"].lower(), frag
        assert c.get(obj["status"]["conditions"], "FragmentationOK")["reason"] == "Unavailable"

        events = await kube.list("v1", "Event", namespace, field_selector="involvedObject.name=tiny")
        reasons = [e["reason"] for e in events]
        assert "ScaledUp" in reasons and "ScaledDown" in reasons

        ok = [r for r in results if r.status == 200]
        shed = [r for r in results if r.status == 429]
        other = [r for r in results if r.status not in (200, 429)]
        assert ok, "no request succeeded"
        assert not other, f"requests lost or failed (not 429): {[(r.status, r.error) for r in other[:5]]}"
        assert all(r.retry_after for r in shed), "a 429 came without Retry-After"
        assert all(r.tokens == 96 for r in ok), "a completed stream was cut short"

        # The dashboards' key panels have data in a real Prometheus scraping the engines, guards and operator.
        empty = [(title, expr) for title, expr in key_panel_queries(namespace, "tiny") if not prom.query(expr)]
        assert not empty, f"dashboard panels without data: {empty}"
    finally:
        follower.cancel()
        prom.stop()
        op.stop()


async def _deployment_with(kube, namespace, replicas):
    d = await kube.get_or_none("apps/v1", "Deployment", "tiny-engine", namespace)
    return d if d and d["spec"]["replicas"] == replicas else None


async def _pods_gone_to(kube, namespace, n):
    pods = await kube.list("v1", "Pod", namespace, label_selector="gpufleet.dev/service=tiny")
    return len(pods) == n
