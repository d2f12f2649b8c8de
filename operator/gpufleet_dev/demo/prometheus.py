"""A local Prometheus (Debian's binary) scraping the operator and the ready
engine pods (the guard's metrics and, through the guard, vLLM's), with
gpufleet's rules loaded."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from gpufleet.manifests import names
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH, GUARD_METRICS_PATH
from gpufleet_kit.kube.pods import is_serving

from ..devcluster.cluster import free_port
from . import vllm_alone

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "rules" / "gpufleet.rules.yaml"


SCRAPE_SECONDS = 2


def config(targets_file: Path, operator_target: str, rules: Path = RULES,
           interval: str = f"{SCRAPE_SECONDS}s") -> dict:
    # Debian's Prometheus is built without Kubernetes service discovery, so the
    # engine pods come from a file that ``follow_pods`` keeps current.
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "gpufleet-operator", "honor_labels": True,
             "static_configs": [{"targets": [operator_target]}]},
            {"job_name": "gpufleet-engines",
             "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "2s"}]},
        ],
    }


# The ``run`` label tells the demo's two runs apart in every series: the operator's engine pods
# (guard and vLLM behind it) and the baseline's vLLM alone (vllm_alone.py).
RUN_GPUFLEET = "gpufleet"


def engine_targets(pods: list[dict]) -> list[dict]:
    """file_sd groups for ready engine pods, labelled like the PodMonitor does: the guard's port
    twice, for its own metrics (endpoint "http") and for vLLM's (endpoint "vllm")."""
    groups = []
    for p in filter(is_serving, pods):
        target = f"{p['status']['podIP']}:{names.GUARD_PORT}"
        labels = {"namespace": p["metadata"]["namespace"], "pod": p["metadata"]["name"],
                  "service": p["metadata"].get("labels", {}).get(names.LABEL_SERVICE, ""), "run": RUN_GPUFLEET}
        for endpoint, path in (("http", GUARD_METRICS_PATH), ("vllm", ENGINE_METRICS_PATH)):
            groups.append({"targets": [target],
                           "labels": {**labels, "endpoint": endpoint, "__metrics_path__": path}})
    return groups


def vllm_alone_targets(pods: list[dict]) -> list[dict]:
    """file_sd groups for the baseline's ready pods: vLLM's own /metrics on its own port."""
    return [{"targets": [f"{p['status']['podIP']}:{names.ENGINE_PORT}"],
             "labels": {"namespace": p["metadata"]["namespace"], "pod": p["metadata"]["name"],
                        "run": vllm_alone.RUN, "endpoint": "vllm", "__metrics_path__": "/metrics"}}
            for p in filter(is_serving, pods)]


def argv(binary: str, config_file: Path, tsdb: Path, port: int) -> list[str]:
    """Prometheus' command line. Exemplar storage on: the guards' and the router's latency buckets carry the
    trace id of a traced request (docs/tracing.md), which Prometheus keeps only with this feature."""
    return [binary, f"--config.file={config_file}", f"--storage.tsdb.path={tsdb}",
            f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"]


def exemplars(url: str, expr: str, start: float, end: float) -> list[dict]:
    """Prometheus' stored exemplars of the series ``expr`` selects between unix times ``start`` and ``end``
    (``/api/v1/query_exemplars``): each series' labels and its exemplars' labels, values and times."""
    doc = httpx.get(f"{url}/api/v1/query_exemplars", params={"query": expr, "start": f"{start:.3f}",
                                                             "end": f"{end:.3f}"}, timeout=10, trust_env=False).json()
    if doc.get("status") != "success":
        raise RuntimeError(f"exemplar query failed: {expr}: {doc}")
    return doc["data"]


class LocalPrometheus:
    def __init__(self, work_dir: Path, operator_target: str):
        self.work_dir = work_dir.resolve()  # Prometheus resolves relative paths against its config's dir
        self.port = free_port()
        self.operator_target = operator_target
        self.targets_file = self.work_dir / "engine-targets.json"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> "LocalPrometheus":
        binary = shutil.which("prometheus")
        if not binary:
            raise RuntimeError("prometheus is not installed: run scripts/install-prometheus.sh")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.work_dir / "prometheus.yml"
        self.targets_file.write_text("[]")
        cfg.write_text(yaml.safe_dump(config(self.targets_file, self.operator_target)))
        self._log = open(self.work_dir / "prometheus.log", "ab")
        self.proc = subprocess.Popen(argv(binary, cfg, self.work_dir / "tsdb", self.port),
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited; see {self.work_dir / 'prometheus.log'}")
            try:
                httpx.get(self.url + "/-/ready", timeout=1, trust_env=False).raise_for_status()
                return self
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("prometheus did not become ready")

    async def follow_pods(self, kube, interval: float = 1.0) -> None:
        """Keep the engine targets file current (runs until cancelled)."""
        while True:
            try:
                pods = await kube.list("v1", "Pod", label_selector=f"{names.LABEL_NAME}={names.ENGINE_APP}")
                alone = await kube.list("v1", "Pod", label_selector=vllm_alone.selector())
                text = json.dumps(engine_targets(pods) + vllm_alone_targets(alone))
                if text != self.targets_file.read_text():
                    tmp = self.targets_file.with_suffix(".tmp")
                    tmp.write_text(text)
                    tmp.rename(self.targets_file)
            except Exception:
                pass  # keep the last targets; the next round retries
            await asyncio.sleep(interval)

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query, at the unix time ``at`` (default: now); the result vector."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        return self._get("/api/v1/query", params, expr)

    def query_range(self, expr: str, start: float, end: float, step: float = 2.0) -> list[dict]:
        """A range query over unix times; the result matrix."""
        return self._get("/api/v1/query_range",
                         {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}, expr)

    def _get(self, path: str, params: dict, expr: str) -> list[dict]:
        doc = httpx.get(f"{self.url}{path}", params=params, timeout=10, trust_env=False).json()
        if doc.get("status") != "success":
            raise RuntimeError(f"query failed: {expr}: {doc}")
        return doc["data"]["result"]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
