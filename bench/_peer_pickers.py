"""The peer Endpoint Pickers of bench/gateway_pickers.py, run as their projects ship them.

- GIE v1.5.0's reference EPP (``cmd/epp``) serving an InferencePool (``--pool-name``; its standalone mode,
  ``--endpoint-selector``, does not start in v1.5.0: Validate requires an empty ``--pool-name`` and the
  datastore then refuses the empty name, "name must not be empty"), its default scorers (queue 2, KV utilisation 2,
  prefix cache 3: pkg/epp/config/loader/defaults.go) plus its LoRA-affinity scorer (weight 1, the trace
  names adapters), metrics read from the guards' ``/metrics/engine`` (vLLM's own /metrics, relayed).
- llm-d's inference scheduler v0.4.0 (``cmd/epp``, GIE v1.2.0's runner) with the configuration its
  deploy/config/epp-precise-prefix-cache-config.yaml gives: the precise prefix-cache scorer fed by vLLM's
  KV events (weight 2), KV utilisation and queue scorers (1 each), max-score picker. Its tokenizer and chat
  template come from the local model folder (``modelTokenizerMap``; no hub access here), its block hashes
  must equal vLLM's (``--prefix-caching-hash-algo sha256_cbor`` and the same ``PYTHONHASHSEED`` on both
  sides), and the events reach it over ZMQ on the topic ``kv@<pod IP>@<model>``.

llm-d's runner (GIE v1.2.0's) starts in the standalone mode. Both are controller-runtime programs that watch
Pods (and GIE's the InferencePool) through a kubeconfig (bench/_standalone_apiserver.py).
Both serve plaintext gRPC by ``--secure-serving=false``, as gpufleet's picker does by its flag.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpufleet_engine.launch.processes import ManagedProcess

CACHE = Path(os.environ.get("GPUFLEET_CACHE", Path.home() / ".cache" / "gpufleet"))
GIE_VERSION = "v1.5.0"
LLMD_VERSION = "v0.4.0"
GIE_BINARY = CACHE / "bin" / f"gie-epp-{GIE_VERSION}-r1" / "epp"
LLMD_BINARY = CACHE / "bin" / f"llmd-epp-{LLMD_VERSION}-r1" / "epp"
BUILD = "scripts/peers/build-pickers.sh"
SELECTOR = {"app": "bench-replica"}
HASH_SEED = "42"  # PYTHONHASHSEED of the engines and hashSeed of llm-d's indexer


def gie_config(metrics_path: str) -> dict:
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"},
                    {"type": "prefix-cache-scorer"}, {"type": "lora-affinity-scorer"},
                    {"type": "metrics-data-source", "parameters": {"path": metrics_path}},
                    {"type": "core-metrics-extractor"}],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": "queue-scorer", "weight": 2}, {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
            {"pluginRef": "prefix-cache-scorer", "weight": 3}, {"pluginRef": "lora-affinity-scorer", "weight": 1}]}],
        "dataLayer": {"sources": [{"pluginRef": "metrics-data-source",
                                   "extractors": [{"pluginRef": "core-metrics-extractor"}]}]},
    }


def llmd_config(tokenizers: dict[str, str], block_size: int, zmq_endpoint: str) -> dict:
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "single-profile-handler"}, {"type": "decode-filter"},
            {"type": "precise-prefix-cache-scorer", "parameters": {
                "indexerConfig": {
                    "tokenProcessorConfig": {"blockSize": block_size, "hashSeed": HASH_SEED},
                    "tokenizersPoolConfig": {"local": {"modelTokenizerMap": tokenizers}},
                    "kvBlockIndexConfig": {"enableMetrics": True}},
                "kvEventsConfig": {"zmqEndpoint": zmq_endpoint, "topicFilter": "kv@", "concurrency": 4}}},
            {"type": "kv-cache-utilization-scorer"}, {"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [{"name": "default", "plugins": [
            # GIE v1.2.0's config reads weights as integers (the sample's 2.0 fails to parse there).
            {"pluginRef": "decode-filter"}, {"pluginRef": "precise-prefix-cache-scorer", "weight": 2},
            {"pluginRef": "kv-cache-utilization-scorer", "weight": 1}, {"pluginRef": "queue-scorer", "weight": 1},
            {"pluginRef": "max-score-picker"}]}],
    }


POOL = "bench-pool"


def common_flags(grpc_port: int, health_port: int, metrics_port: int) -> list[str]:
    return [f"--grpc-port={grpc_port}", f"--grpc-health-port={health_port}", f"--metrics-port={metrics_port}",
            "--pool-namespace=default", "--secure-serving=false", "--health-checking=true",
            "--metrics-endpoint-auth=false", "--enable-pprof=false", "--tracing=false", "--v=1"]


def standalone_flags(target_port: int) -> list[str]:
    selector = ",".join(f"{k}={v}" for k, v in SELECTOR.items())
    return [f"--endpoint-selector={selector}", f"--endpoint-target-ports={target_port}"]


def inference_pool(target_port: int, picker: str, grpc_port: int) -> dict:
    """The InferencePool the operator renders for a service (inference.networking.k8s.io/v1)."""
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": "default"},
            "spec": {"selector": {"matchLabels": SELECTOR}, "targetPorts": [{"number": target_port}],
                     "endpointPickerRef": {"name": picker, "port": {"number": grpc_port}}}}


def gie_argv(ports: tuple[int, int, int], metrics_path: str) -> list[str]:
    return [str(GIE_BINARY), *common_flags(*ports), f"--pool-name={POOL}",
            f"--config-text={json.dumps(gie_config(metrics_path))}"]


def llmd_argv(ports: tuple[int, int, int], target_port: int, metrics_path: str, config_file: Path) -> list[str]:
    # GIE v1.2.0's runner: metrics path by flag, and v1.2.0 flags only.
    return [str(LLMD_BINARY), *common_flags(*ports), *standalone_flags(target_port),
            f"--model-server-metrics-path={metrics_path}", f"--config-file={config_file}"]


def gie_crds() -> list[dict]:
    """GIE v1.5.0's CRDs (config/crd/bases of its module), for the throwaway API server."""
    import yaml

    module = f"sigs.k8s.io/gateway-api-inference-extension@{GIE_VERSION}"
    out = subprocess.run(["go", "mod", "download", "-json", module], check=True, capture_output=True, text=True,
                         cwd=CACHE)
    bases = Path(json.loads(out.stdout)["Dir"]) / "config" / "crd" / "bases"
    return [yaml.safe_load(p.read_text()) for p in sorted(bases.glob("*.yaml"))]


def llmd_env(python_site: str, wrapper_dir: str) -> dict[str, str]:
    """llm-d embeds Python to render chat templates: it imports its wrapper module and transformers."""
    # No hub here: fail at once instead of retrying the network for every request.
    return {"PYTHONHASHSEED": HASH_SEED, "PYTHONPATH": os.pathsep.join([wrapper_dir, python_site]),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def llmd_wrapper_dir() -> str:
    """The folder of llm-d's render_jinja_template_wrapper.py in the Go module cache (its image copies it)."""
    out = subprocess.run(["go", "mod", "download", "-json", "github.com/llm-d/llm-d-kv-cache-manager@v0.4.0"],
                         check=True, capture_output=True, text=True, cwd=CACHE)
    return str(Path(json.loads(out.stdout)["Dir"]) / "pkg" / "preprocessing" / "chat_completions")


def site_packages() -> str:
    import transformers

    return str(Path(transformers.__file__).resolve().parents[1])


class PickerProcess:
    def __init__(self, name: str, argv: list[str], work: Path, kubeconfig: Path | None,
                 env: dict[str, str] | None = None, cpu_cores: str | None = None):
        self.name, self.argv, self.work = name, argv, work
        # Standalone, GIE's runner names its pool after the Deployment of its own pod (the downward API's
        # POD_NAME, parsed as <deployment>-<replica set hash>-<pod suffix>).
        pod = f"{name}-7c9d8b6f5-bench"
        self.env = {**os.environ, **({"KUBECONFIG": str(kubeconfig), "POD_NAME": pod, "NAMESPACE": "default"}
                                     if kubeconfig else {}), **(env or {})}
        self.cpu_cores = cpu_cores

    def start(self) -> "PickerProcess":
        argv = ["taskset", "-c", self.cpu_cores, *self.argv] if self.cpu_cores else self.argv
        self.log_path = self.work / f"{self.name}.log"
        self.proc = ManagedProcess(self.name, argv, self.env, log_path=self.log_path, cwd=self.work)
        self.proc.start()
        return self

    def alive(self) -> bool:
        return self.proc.running

    def metrics(self, port: int) -> str:
        """Its Prometheus text (controller-runtime's registry: the scheduler's and plugins' own figures)."""
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, trust_env=False).text
        except httpx.HTTPError as e:
            return f"# unreadable: {e}"

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        self.proc.stop(10)


def missing_binary(path: Path, what: str) -> str | None:
    if path.exists():
        return None
    return f"{what} is not built: {BUILD} (kept out of setup and make test); expected {path}"


if __name__ == "__main__":
    print(json.dumps(gie_config(sys.argv[1] if len(sys.argv) > 1 else "/metrics"), indent=1))


class EventRelay:
    """vLLM's KV events to llm-d's indexer: each engine binds its publisher on an ipc socket (so any
    subscriber can come and go), and while llm-d's arm runs this forwards every message, topic and all,
    to the socket llm-d's indexer binds, as vLLM would publish to it directly."""

    def __init__(self, engine_endpoints: list[str], indexer_endpoint: str):
        self.engine_endpoints, self.indexer_endpoint = engine_endpoints, indexer_endpoint

    def start(self) -> "EventRelay":
        import zmq
        from zmq.devices import ThreadDevice

        self.device = ThreadDevice(zmq.FORWARDER, zmq.SUB, zmq.PUB)
        for endpoint in self.engine_endpoints:
            self.device.connect_in(endpoint)
        self.device.setsockopt_in(zmq.SUBSCRIBE, b"")
        self.device.connect_out(self.indexer_endpoint)
        self.device.start()
        return self

    def stop(self) -> None:
        # The device's thread owns a context of its own; destroying it ends the forwarder.
        ctx = getattr(self.device, "_context", None)
        if ctx is not None:
            ctx.destroy(linger=0)
