"""A local Prometheus (Debian's binary) that discovers the operator and the
engine pods through the local API server, with gpufleet's rules loaded."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "rules" / "gpufleet.rules.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(kubeconfig: str, operator_target: str, rules: Path = RULES, interval: str = "2s") -> dict:
    pod_relabel = [
        {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"], "regex": "gpufleet-engine",
         "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "http|vllm", "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_ready"], "regex": "true", "action": "keep"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_label_gpufleet_dev_service"], "target_label": "service"},
    ]
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "gpufleet-operator", "honor_labels": True,
             "static_configs": [{"targets": [operator_target]}]},
            {"job_name": "gpufleet-engines",
             "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": kubeconfig}],
             "relabel_configs": pod_relabel},
        ],
    }


class LocalPrometheus:
    def __init__(self, work_dir: Path, kubeconfig: str, operator_target: str):
        self.work_dir = work_dir
        self.port = _free_port()
        self.kubeconfig = kubeconfig
        self.operator_target = operator_target
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
        cfg.write_text(yaml.safe_dump(config(self.kubeconfig, self.operator_target)))
        self._log = open(self.work_dir / "prometheus.log", "ab")
        self.proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={self.work_dir / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited; see {self.work_dir / 'prometheus.log'}")
            try:
                urllib.request.urlopen(self.url + "/-/ready", timeout=1)
                return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("prometheus did not become ready")

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
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
