"""The guard's configuration: ``guard.json`` parsed and validated.

The contract is documented in ``docs/guard-config.md``; the operator renders
the file, this module reads it. Every problem is reported at once, each naming
the field and how to fix it, because the file is usually written by a machine
and read by a person only when it is wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

OVER_LENGTH_POLICIES = ("Reject", "TruncateLeft")
RUNTIMES = ("vllm", "vllm-cpu")
PROXIED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class ConfigError(ValueError):
    """``guard.json`` is invalid; ``problems`` lists every field that is wrong."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid guard config:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class QueueClass:
    name: str
    level: int  # 1 is served first
    max_queue_seconds: float


@dataclass(frozen=True)
class SpeculativeConfig:
    model: str
    num_tokens: int


@dataclass(frozen=True)
class EngineConfig:
    runtime: str = "vllm"
    model: str = ""
    served_model_name: str = ""
    host: str = "0.0.0.0"
    port: int = 8000
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    block_size: int = 32
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: vLLM's own choice
    quantization: str | None = None
    speculative: SpeculativeConfig | None = None
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_space_gib: int | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class GuardConfig:
    served_model_name: str
    tokenizer: str
    service: str = ""
    namespace: str = ""
    listen_host: str = "0.0.0.0"
    listen_port: int = 8080
    engine_url: str = "http://127.0.0.1:8000"
    block_size: int = 32
    kv_watermark_percent: int = 5
    max_context_tokens: int = 4096
    over_length_policy: str = "Reject"
    request_timeout_seconds: float = 300
    drain_timeout_seconds: float = 300
    max_concurrency: int = 64
    max_queue_length: int = 1024
    class_header: str = "x-gpufleet-class"
    aging_seconds: float = 5
    retry_after_seconds: float = 1
    queue_classes: tuple[QueueClass, ...] = (
        QueueClass("interactive", 1, 2),
        QueueClass("standard", 2, 10),
        QueueClass("background", 3, 60),
    )
    default_class_by_route: Mapping[str, str] = field(default_factory=lambda: _default_routes())
    metrics_poll_seconds: float = 0.5
    engine: EngineConfig | None = None

    def queue_class(self, name: str) -> QueueClass | None:
        return next((c for c in self.queue_classes if c.name == name), None)


def load(path: str | Path) -> GuardConfig:
    """Read and validate ``guard.json``."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found; mount the <service>-guard ConfigMap there "
                           f"or pass --config PATH"]) from None
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}: not valid JSON ({e})"]) from None
    return parse(raw)


def parse(raw: Any) -> GuardConfig:
    """Validate a decoded ``guard.json`` document; raise ConfigError listing every problem."""
    r = _Reader(raw, "")
    r.seen.add("engine")
    engine = _parse_engine(r.section("engine"), r.problems) if r.raw.get("engine") is not None else None

    served = r.string("servedModelName", default=engine.served_model_name if engine else None)
    tokenizer = r.string("tokenizer", default=engine.model if engine else None)
    classes = _parse_classes(r)
    class_names = {c.name for c in classes}
    routes = r.mapping("defaultClassByRoute", default=_default_routes())
    for route, name in routes.items():
        if route not in PROXIED_ROUTES:
            r.problems.append(f"defaultClassByRoute: unknown route {route!r}; "
                              f"routes are {', '.join(PROXIED_ROUTES)}")
        if name not in class_names:
            r.problems.append(f"defaultClassByRoute[{route!r}]: class {name!r} is not in queueClasses "
                              f"({', '.join(sorted(class_names))}); add it there or name an existing class")
    builtin = _default_routes()
    for route in PROXIED_ROUTES:
        if route not in routes and classes:
            # An unmapped route gets its built-in class if configured, else the first level.
            routes[route] = builtin[route] if builtin[route] in class_names else \
                min(classes, key=lambda c: c.level).name

    cfg = dict(
        served_model_name=served or "",
        tokenizer=tokenizer or "",
        service=r.string("service", default=""),
        namespace=r.string("namespace", default=""),
        listen_host=r.string("listenHost", default="0.0.0.0"),
        listen_port=r.integer("listenPort", default=8080, low=0, high=65535),
        engine_url=r.string("engineUrl", default="http://127.0.0.1:8000"),
        block_size=r.integer("blockSize", default=engine.block_size if engine else 32, low=1),
        kv_watermark_percent=r.integer("kvWatermarkPercent", default=5, low=0, high=99),
        max_context_tokens=r.integer("maxContextTokens", default=engine.max_model_len if engine else 4096,
                                     low=1),
        over_length_policy=r.enum("overLengthPolicy", OVER_LENGTH_POLICIES, default="Reject"),
        request_timeout_seconds=r.number("requestTimeoutSeconds", default=300, positive=True),
        drain_timeout_seconds=r.number("drainTimeoutSeconds", default=300, positive=False),
        max_concurrency=r.integer("maxConcurrency", default=64, low=1),
        max_queue_length=r.integer("maxQueueLength", default=1024, low=0),
        class_header=r.string("classHeader", default="x-gpufleet-class").lower(),
        aging_seconds=r.number("agingSeconds", default=5, positive=True),
        retry_after_seconds=r.number("retryAfterSeconds", default=1, positive=True),
        queue_classes=tuple(classes),
        default_class_by_route=routes,
        metrics_poll_seconds=r.number("metricsPollSeconds", default=0.5, positive=True),
        engine=engine,
    )
    r.reject_unknown()
    if not served:
        r.problems.append("servedModelName: required (or set engine.servedModelName); "
                          "it is the model name clients send")
    if not tokenizer:
        r.problems.append("tokenizer: required (or set engine.model); a local folder or model id "
                          "whose tokenizer counts prompt tokens")
    if not cfg["engine_url"].startswith(("http://", "https://")):
        r.problems.append(f"engineUrl: {cfg['engine_url']!r} is not an http(s) URL; "
                          f"use e.g. http://127.0.0.1:8000")
    if engine is not None:
        if engine.block_size != cfg["block_size"]:
            r.problems.append(f"blockSize: {cfg['block_size']} differs from engine.blockSize "
                              f"{engine.block_size}; the guard's block arithmetic must match vLLM's, "
                              f"set both to the same value")
        if cfg["max_context_tokens"] > engine.max_model_len:
            r.problems.append(f"maxContextTokens: {cfg['max_context_tokens']} exceeds engine.maxModelLen "
                              f"{engine.max_model_len}; vLLM would refuse what the guard admits, "
                              f"lower maxContextTokens or raise engine.maxModelLen")
    if r.problems:
        raise ConfigError(r.problems)
    return GuardConfig(**cfg)


def _default_routes() -> dict[str, str]:
    return {"/v1/chat/completions": "interactive", "/v1/completions": "standard",
            "/v1/embeddings": "background"}


def _parse_classes(r: "_Reader") -> list[QueueClass]:
    raw = r.raw.get("queueClasses") if isinstance(r.raw, dict) else None
    r.seen.add("queueClasses")
    if raw is None:
        return list(GuardConfig.queue_classes)
    if not isinstance(raw, list) or not raw:
        r.problems.append("queueClasses: must be a non-empty list of {name, level, maxQueueSeconds}")
        return []
    classes = []
    for i, item in enumerate(raw):
        c = _Reader(item, f"queueClasses[{i}].", r.problems)
        name = c.string("name")
        level = c.integer("level", low=1)
        max_q = c.number("maxQueueSeconds", positive=True)
        c.reject_unknown()
        if name is not None and level is not None and max_q is not None:
            classes.append(QueueClass(name, level, float(max_q)))
    names = [c.name for c in classes]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        r.problems.append(f"queueClasses: class {dup!r} appears twice; class names must be unique")
    return classes


def _parse_engine(e: "_Reader", problems: list[str]) -> EngineConfig | None:
    runtime = e.enum("runtime", RUNTIMES, default="vllm")
    model = e.string("model")
    spec_raw = e.raw.get("speculative") if isinstance(e.raw, dict) else None
    e.seen.add("speculative")
    speculative = None
    if spec_raw is not None:
        s = _Reader(spec_raw, "engine.speculative.", problems)
        s_model = s.string("model")
        s_tokens = s.integer("numTokens", default=5, low=1)
        s.reject_unknown()
        if s_model:
            speculative = SpeculativeConfig(s_model, s_tokens)
    extra = e.raw.get("extraArgs", []) if isinstance(e.raw, dict) else []
    e.seen.add("extraArgs")
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        problems.append("engine.extraArgs: must be a list of strings, e.g. [\"--enforce-eager\"]")
        extra = []
    block_size = e.integer("blockSize", default=32, low=1)
    max_model_len = e.integer("maxModelLen", default=4096, low=1)
    blocks = e.integer("numGpuBlocksOverride", default=None, low=2)
    cpu_space = e.integer("cpuKvCacheSpaceGiB", default=None, low=1)
    cfg = EngineConfig(
        runtime=runtime,
        model=model or "",
        served_model_name=e.string("servedModelName", default=model or ""),
        host=e.string("host", default="0.0.0.0"),
        port=e.integer("port", default=8000, low=1, high=65535),
        max_model_len=max_model_len,
        tensor_parallel_size=e.integer("tensorParallelSize", default=1, low=1),
        gpu_memory_utilization=e.number("gpuMemoryUtilization", default=0.9, positive=True),
        block_size=block_size,
        kv_cache_dtype=e.string("kvCacheDtype", default="auto"),
        dtype=e.string("dtype", default="auto"),
        enable_prefix_caching=e.boolean("enablePrefixCaching", default=True),
        max_num_seqs=e.integer("maxNumSeqs", default=256, low=1),
        max_num_batched_tokens=e.integer("maxNumBatchedTokens", default=None, low=1),
        quantization=e.string("quantization", default=None),
        speculative=speculative,
        num_gpu_blocks_override=blocks,
        cpu_kv_cache_space_gib=cpu_space,
        extra_args=tuple(extra),
    )
    e.reject_unknown()
    if cfg.gpu_memory_utilization is not None and cfg.gpu_memory_utilization > 1:
        problems.append(f"engine.gpuMemoryUtilization: {cfg.gpu_memory_utilization} is a fraction of GPU "
                        f"memory; use a value in (0, 1], e.g. 0.9")
    if runtime == "vllm-cpu" and block_size and block_size % 32:
        problems.append(f"engine.blockSize: {block_size} is not a multiple of 32, which vLLM's CPU "
                        f"backend requires; use 32")
    if blocks and block_size and max_model_len and max_model_len > (blocks - 1) * block_size:
        # vLLM keeps one block back and refuses to start when one request of
        # maxModelLen tokens cannot fit in the rest.
        problems.append(f"engine.maxModelLen: {max_model_len} tokens do not fit in numGpuBlocksOverride "
                        f"{blocks} blocks of {block_size} (vLLM keeps one block back); lower maxModelLen "
                        f"to at most {(blocks - 1) * block_size} or raise numGpuBlocksOverride")
    from .flags import derived_flag_names  # flags imports config; import here to keep the cycle one-way

    clashes = sorted({a.split("=", 1)[0] for a in extra} & derived_flag_names())
    if clashes:
        problems.append(f"engine.extraArgs: {', '.join(clashes)} derived from other engine fields; "
                        f"set those fields instead of passing the flag")
    return cfg


_MISSING = object()


class _Reader:
    """Typed field access on one JSON object, collecting problems instead of raising."""

    def __init__(self, raw: Any, prefix: str, problems: list[str] | None = None):
        self.prefix = prefix
        self.problems = problems if problems is not None else []
        self.seen: set[str] = set()
        if not isinstance(raw, dict):
            self.problems.append(f"{prefix.rstrip('.') or 'guard.json'}: must be a JSON object")
            raw = {}
        self.raw = raw

    def section(self, key: str) -> "_Reader":
        self.seen.add(key)
        return _Reader(self.raw.get(key), f"{self.prefix}{key}.", self.problems)

    def _get(self, key: str, default: Any) -> Any:
        self.seen.add(key)
        value = self.raw.get(key, _MISSING)
        if value is _MISSING or (value is None and default is not _MISSING):
            if default is _MISSING:
                self.problems.append(f"{self.prefix}{key}: required")
                return None
            return default
        return value

    def string(self, key: str, default: Any = _MISSING) -> str | None:
        v = self._get(key, default)
        if v is None or v is default:
            return v
        if not isinstance(v, str):
            self.problems.append(f"{self.prefix}{key}: must be a string, got {v!r}")
            return None if default is _MISSING else default
        return v

    def integer(self, key: str, default: Any = _MISSING, low: int | None = None,
                high: int | None = None) -> int | None:
        v = self._get(key, default)
        if v is None or v is default:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            self.problems.append(f"{self.prefix}{key}: must be an integer, got {v!r}")
            return None if default is _MISSING else default
        if low is not None and v < low or high is not None and v > high:
            bounds = f"at least {low}" if high is None else f"between {low} and {high}"
            self.problems.append(f"{self.prefix}{key}: {v} is out of range; use a value {bounds}")
        return v

    def number(self, key: str, default: Any = _MISSING, positive: bool = False) -> float | None:
        v = self._get(key, default)
        if v is None or v is default:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.problems.append(f"{self.prefix}{key}: must be a number, got {v!r}")
            return None if default is _MISSING else default
        if v < 0 or (positive and v == 0):
            self.problems.append(f"{self.prefix}{key}: {v} must be {'greater than 0' if positive else '0 or more'}")
        return float(v)

    def boolean(self, key: str, default: Any = _MISSING) -> bool | None:
        v = self._get(key, default)
        if v is not None and v is not default and not isinstance(v, bool):
            self.problems.append(f"{self.prefix}{key}: must be true or false, got {v!r}")
            return None if default is _MISSING else default
        return v

    def enum(self, key: str, allowed: tuple[str, ...], default: Any = _MISSING) -> str | None:
        v = self._get(key, default)
        if v is not None and v is not default and v not in allowed:
            self.problems.append(f"{self.prefix}{key}: {v!r} is not one of {', '.join(allowed)}")
            return None if default is _MISSING else default
        return v

    def mapping(self, key: str, default: Any = _MISSING) -> dict[str, str]:
        v = self._get(key, default)
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
            self.problems.append(f"{self.prefix}{key}: must be an object of route → class name")
            return {}
        return dict(v)

    def reject_unknown(self) -> None:
        # Unknown keys are usually typos ("kvWatermarkPercnt") that would
        # otherwise silently fall back to a default.
        for key in sorted(set(self.raw) - self.seen):
            self.problems.append(f"{self.prefix}{key}: unknown field; check the spelling against "
                                 f"docs/guard-config.md")
