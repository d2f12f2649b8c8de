"""``guard.json``: the one typed model of the guard's configuration.

The operator builds a ``GuardConfig`` from the InferenceService and renders it
with ``to_document``; the guard reads the file back with ``load``/``parse``.
Each field is declared once below, with its JSON key, its default and its
bounds, so writer and reader cannot drift (docs/guard-config.md documents the
fields; a contract test renders random valid specs and parses each).

The reader reports every problem at once, each naming the field and how to fix
it, because the file is usually written by a machine and read by a person only
when it is wrong.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from .engine_flags import MANAGED_FLAGS, managed_flags_in

OVER_LENGTH_POLICIES = ("Reject", "TruncateLeft")
# Predicted: prompt + the mean output length the guard has learned (the ledger adds one
# margin for all requests in flight, at reservation_quantile_percent),
# grown while the answer streams past it. FullBudget: prompt + max_tokens (or
# the rest of the context), the worst case.
RESERVATIONS = ("Predicted", "FullBudget")
# Objective: fewer requests run in vLLM at once while more would start later than the TTFT
# objective allows, while the replica is overloaded (ttft_limit.py). Off: max_concurrency is
# the only limit.
TTFT_CONTROLS = ("Objective", "Off")
RUNTIMES = ("vllm", "vllm-cpu")
PROXIED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
CLASS_HEADER = "x-gpufleet-class"
# LowerOnly: the class header may ask for the route's default class or a lower
# priority (a higher level number), never a higher one. Trusted: any class, for
# a gateway in front that sets the header itself and drops the client's.
CLASS_HEADER_POLICIES = ("LowerOnly", "Trusted")


class ConfigError(ValueError):
    """``guard.json`` is invalid; ``problems`` lists every field that is wrong."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid guard config:\n  - " + "\n  - ".join(problems))


def _field(default: Any = dataclasses.MISSING, *, key: str | None = None, low: float | None = None,
           high: float | None = None, positive: bool = False, choices: tuple[str, ...] | None = None,
           from_engine: str | None = None, live: bool = False, factory: Any = dataclasses.MISSING) -> Any:
    """A field of guard.json. ``from_engine``: left out, it takes the engine section's field of
    that name (so a file with an ``engine`` section need not repeat it). ``live``: a running guard
    applies a new value when the file changes (``reload.py``); every other field (vLLM's engine
    section, the guard's layout) needs the pod restarted, and only those change the pod template."""
    meta = {"key": key, "low": low, "high": high, "positive": positive, "choices": choices,
            "from_engine": from_engine, "live": live}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class QueueClass:
    name: str = _field()
    level: int = _field(low=1)  # 1 is served first
    max_queue_seconds: float = _field(positive=True)


@dataclass(frozen=True)
class SpeculativeConfig:
    model: str = _field()
    num_tokens: int = _field(5, low=1)


@dataclass(frozen=True)
class EngineConfig:
    model: str = _field()
    runtime: str = _field("vllm", choices=RUNTIMES)
    served_model_name: str = _field("")  # empty: the model
    host: str = _field("0.0.0.0")
    port: int = _field(8000, low=1, high=65535)
    # None: the model's own context (vLLM reads it from the model's config); the guard then
    # learns it from vLLM's /v1/models before it admits anything.
    max_model_len: Optional[int] = _field(None, low=1)
    # The model repository's revision (branch, tag or commit): --revision and --tokenizer-revision.
    revision: Optional[str] = _field(None)
    tensor_parallel_size: int = _field(1, low=1)
    gpu_memory_utilization: float = _field(0.9, positive=True, high=1)
    block_size: int = _field(32, low=1)
    kv_cache_dtype: str = _field("auto")
    dtype: str = _field("auto")
    enable_prefix_caching: bool = _field(True)
    max_num_seqs: int = _field(256, low=1)
    max_num_batched_tokens: Optional[int] = _field(None, low=1)  # None: vLLM's own choice
    quantization: Optional[str] = _field(None)
    speculative: Optional[SpeculativeConfig] = _field(None)
    num_gpu_blocks_override: Optional[int] = _field(None, low=2)
    cpu_kv_cache_space_gib: Optional[int] = _field(None, low=1, key="cpuKvCacheSpaceGiB")
    extra_args: tuple[str, ...] = _field(())


@dataclass(frozen=True)
class SLOConfig:
    """The service's objectives, against which the guard counts each request good or bad
    (``gpufleet_guard_sli_*``): burn rates then need no histogram bucket at the objective."""
    ttft_p99_seconds: float = _field(2.0, positive=True)
    itl_p99_seconds: float = _field(0.1, positive=True)
    # Non-streaming requests: their whole answer is their first token.
    request_p99_seconds: float = _field(60.0, positive=True)


def _default_classes() -> tuple[QueueClass, ...]:
    return (QueueClass("interactive", 1, 2), QueueClass("standard", 2, 10), QueueClass("background", 3, 60))


def default_routes(classes: tuple[QueueClass, ...] | list[QueueClass]) -> dict[str, str]:
    """Chat to the first level, completions to level 2 (else the first), embeddings to the last."""
    by_level = sorted(classes, key=lambda c: (c.level, c.name))
    first, last = by_level[0].name, by_level[-1].name
    middle = next((c.name for c in by_level if c.level == 2), first)
    return {"/v1/chat/completions": first, "/v1/completions": middle, "/v1/embeddings": last}


@dataclass(frozen=True)
class GuardConfig:
    served_model_name: str = _field("", from_engine="served_model_name")
    tokenizer: str = _field("", from_engine="model")
    tokenizer_revision: Optional[str] = _field(None, from_engine="revision")
    service: str = _field("")
    namespace: str = _field("")
    listen_host: str = _field("0.0.0.0")
    listen_port: int = _field(8080, low=0, high=65535)
    engine_url: str = _field("http://127.0.0.1:8000")
    block_size: int = _field(32, low=1, from_engine="block_size")
    kv_watermark_percent: int = _field(5, low=0, high=99, live=True)
    reservation: str = _field("Predicted", choices=RESERVATIONS, live=True)
    reservation_quantile_percent: int = _field(90, low=50, high=100, live=True)
    # None: the context vLLM serves (engine.maxModelLen, or what vLLM's /v1/models reports).
    max_context_tokens: Optional[int] = _field(None, low=1, from_engine="max_model_len", live=True)
    over_length_policy: str = _field("Reject", choices=OVER_LENGTH_POLICIES, live=True)
    request_timeout_seconds: float = _field(300, positive=True, live=True)
    drain_timeout_seconds: float = _field(300, live=True)
    max_concurrency: int = _field(64, low=1, live=True)
    ttft_control: str = _field("Objective", choices=TTFT_CONTROLS, live=True)
    max_queue_length: int = _field(1024, low=0, live=True)
    class_header: str = _field(CLASS_HEADER, live=True)
    class_header_policy: str = _field("LowerOnly", choices=CLASS_HEADER_POLICIES, live=True)
    aging_seconds: float = _field(5, positive=True, live=True)
    retry_after_seconds: float = _field(1, positive=True, live=True)
    queue_classes: tuple[QueueClass, ...] = _field(factory=_default_classes, live=True)
    # Routes left out get default_routes(queue_classes).
    default_class_by_route: Mapping[str, str] = _field(factory=dict, live=True)
    metrics_poll_seconds: float = _field(0.5, positive=True, live=True)
    slo: SLOConfig = _field(factory=SLOConfig, live=True)
    engine: Optional[EngineConfig] = _field(None)

    def queue_class(self, name: str) -> QueueClass | None:
        return next((c for c in self.queue_classes if c.name == name), None)

    def classes_allowed(self, route: str) -> tuple[QueueClass, ...]:
        """The classes a request on ``route`` may ask for with the class header."""
        if self.class_header_policy == "Trusted":
            return self.queue_classes
        floor = self.queue_class(self.default_class_by_route[route])
        return tuple(c for c in self.queue_classes if floor is None or c.level >= floor.level)


# --- writing ---------------------------------------------------------------------------


def key_of(f: dataclasses.Field) -> str:
    if f.metadata.get("key"):
        return f.metadata["key"]
    head, *rest = f.name.split("_")
    return head + "".join(p.capitalize() for p in rest)


def to_document(config: GuardConfig) -> dict:
    """The JSON document for ``config``: every field, so the ConfigMap shows what the guard runs with."""
    return _encode(config)


def render(config: GuardConfig) -> str:
    return json.dumps(to_document(config), indent=2, sort_keys=True)


LIVE_FIELDS = tuple(f.name for f in dataclasses.fields(GuardConfig) if f.metadata.get("live"))


def restart_document(config: GuardConfig) -> dict:
    """The part of the document a running pod cannot take without a restart: vLLM's ``engine``
    section and the guard's layout (addresses, model, tokenizer). The operator hashes only this
    into the pod template; the ``live`` fields the guard re-reads from the mounted file."""
    live = {key_of(f) for f in dataclasses.fields(GuardConfig) if f.name in LIVE_FIELDS}
    return {k: v for k, v in to_document(config).items() if k not in live}


def restart_changes(running: GuardConfig, new: GuardConfig) -> list[str]:
    """Keys of the fields that differ between ``running`` and ``new`` and need a restart."""
    return sorted(key_of(f) for f in dataclasses.fields(GuardConfig)
                  if f.name not in LIVE_FIELDS and getattr(running, f.name) != getattr(new, f.name))


def live_changes(running: GuardConfig, new: GuardConfig) -> list[str]:
    """Keys of the live fields that differ between ``running`` and ``new``."""
    return sorted(key_of(f) for f in dataclasses.fields(GuardConfig)
                  if f.name in LIVE_FIELDS and getattr(running, f.name) != getattr(new, f.name))


def with_live_fields(running: GuardConfig, new: GuardConfig) -> GuardConfig:
    """``running`` with the live fields of ``new``, checked together as one file (a new
    maxContextTokens must still fit the engine the guard runs with)."""
    merged = dataclasses.replace(running, **{name: getattr(new, name) for name in LIVE_FIELDS})
    return parse(to_document(merged))


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {key_of(f): _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    return value


# --- reading ---------------------------------------------------------------------------


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
    problems: list[str] = []
    values = _read(GuardConfig, raw, "", problems)
    engine: EngineConfig | None = values.get("engine")
    if engine is not None:
        for f in dataclasses.fields(GuardConfig):
            source = f.metadata.get("from_engine")
            if source and isinstance(raw, dict) and raw.get(key_of(f)) is None:
                values[f.name] = getattr(engine, source)
    _check_guard(values, problems)
    if problems:
        raise ConfigError(problems)
    return GuardConfig(**values)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read(cls: type, raw: Any, prefix: str, problems: list[str]) -> dict[str, Any]:
    """Each field of ``cls`` from the JSON object ``raw``, defaults for those left out or null."""
    where = prefix.rstrip(".") or "guard.json"
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be a JSON object")
        raw = {}
    hints = _hints(cls)
    values: dict[str, Any] = {}
    known = set()
    for f in dataclasses.fields(cls):
        key = key_of(f)
        known.add(key)
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        value = raw.get(key)
        if value is None:
            if not has_default:
                problems.append(f"{prefix}{key}: required")
                values[f.name] = None
            elif f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            else:
                values[f.name] = typing.cast(typing.Callable[[], Any], f.default_factory)()
            continue
        values[f.name] = _value(hints[f.name], f, value, f"{prefix}{key}", problems)
    if cls is EngineConfig and not values.get("served_model_name"):
        values["served_model_name"] = values.get("model") or ""
    for key in sorted(set(raw) - known):
        # Unknown keys are usually typos ("kvWatermarkPercnt") that would
        # otherwise silently fall back to a default.
        problems.append(f"{prefix}{key}: unknown field; check the spelling against docs/guard-config.md")
    return values


def _value(hint: Any, f: dataclasses.Field, value: Any, where: str, problems: list[str]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    fallback = None if f.default is dataclasses.MISSING else f.default
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _object(hint, value, where, problems)
    if origin is tuple:
        return _list(args[0], value, where, problems)
    if origin in (collections.abc.Mapping, dict):
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items()):
            problems.append(f"{where}: must be an object of route → class name")
            return {}
        return dict(value)
    meta = f.metadata
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(f"{where}: must be true or false, got {value!r}")
            return fallback
        return value
    if hint is str:
        if not isinstance(value, str):
            problems.append(f"{where}: must be a string, got {value!r}")
            return fallback
        if meta.get("choices") and value not in meta["choices"]:
            problems.append(f"{where}: {value!r} is not one of {', '.join(meta['choices'])}")
            return fallback
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{where}: must be an integer, got {value!r}")
            return fallback
        low, high = meta.get("low"), meta.get("high")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"between {low} and {high}"
            problems.append(f"{where}: {value} is out of range; use a value {bounds}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: must be a number, got {value!r}")
            return fallback
        positive = meta.get("positive")
        if value < 0 or (positive and value == 0):
            problems.append(f"{where}: {value} must be {'greater than 0' if positive else '0 or more'}")
        elif meta.get("high") is not None and value > meta["high"]:
            problems.append(f"{where}: {value} is above {meta['high']}")
        return float(value)
    raise TypeError(f"guard_config: no reader for {hint!r}")  # a new field type needs one


def _object(cls: type, value: Any, where: str, problems: list[str]) -> Any:
    before = len(problems)
    values = _read(cls, value, where + ".", problems)
    if cls is EngineConfig:
        _check_engine(values, where, problems)
    if len(problems) > before or any(v is None for k, v in values.items() if _required(cls, k)):
        return None if cls is not EngineConfig else _partial(cls, values)
    return cls(**values)


def _required(cls: type, name: str) -> bool:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _partial(cls: type, values: dict[str, Any]) -> Any:
    # An invalid engine section still yields an object, so the top-level checks
    # (block size, context length) can report their problems in the same pass.
    try:
        return cls(**values)
    except TypeError:
        return None


def _list(item: Any, value: Any, where: str, problems: list[str]) -> tuple:
    if item is str:
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            problems.append(f"{where}: must be a list of strings, e.g. [\"--enforce-eager\"]")
            return ()
        return tuple(value)
    if not isinstance(value, list) or not value:
        problems.append(f"{where}: must be a non-empty list of {{name, level, maxQueueSeconds}}")
        return ()
    out = [_object(item, v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    return tuple(o for o in out if o is not None)


# --- checks across fields --------------------------------------------------------------


def _check_engine(e: dict[str, Any], where: str, problems: list[str]) -> None:
    runtime, block_size = e.get("runtime"), e.get("block_size")
    blocks, max_model_len = e.get("num_gpu_blocks_override"), e.get("max_model_len")
    if runtime == "vllm-cpu" and isinstance(block_size, int) and block_size % 32:
        problems.append(f"{where}.blockSize: {block_size} is not a multiple of 32, which vLLM's CPU "
                        f"backend requires; use 32")
    if isinstance(blocks, int) and isinstance(block_size, int) and isinstance(max_model_len, int) \
            and max_model_len > (blocks - 1) * block_size:
        # vLLM keeps one block back and refuses to start when one request of
        # maxModelLen tokens cannot fit in the rest.
        problems.append(f"{where}.maxModelLen: {max_model_len} tokens do not fit in numGpuBlocksOverride "
                        f"{blocks} blocks of {block_size} (vLLM keeps one block back); lower maxModelLen "
                        f"to at most {(blocks - 1) * block_size} or raise numGpuBlocksOverride")
    clashes = managed_flags_in(e.get("extra_args") or ())
    for _, flag in clashes:
        problems.append(f"{where}.extraArgs: {flag} is managed by gpufleet; remove it and "
                        f"{MANAGED_FLAGS[flag]}")


def _check_guard(values: dict[str, Any], problems: list[str]) -> None:
    classes: tuple[QueueClass, ...] = values["queue_classes"]
    names = [c.name for c in classes]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"queueClasses: class {dup!r} appears twice; class names must be unique")
    routes = dict(values["default_class_by_route"])
    for route, name in routes.items():
        if route not in PROXIED_ROUTES:
            problems.append(f"defaultClassByRoute: unknown route {route!r}; routes are {', '.join(PROXIED_ROUTES)}")
        if name not in names:
            problems.append(f"defaultClassByRoute[{route!r}]: class {name!r} is not in queueClasses "
                            f"({', '.join(sorted(names))}); add it there or name an existing class")
    if classes:
        values["default_class_by_route"] = {**default_routes(classes), **routes}
    values["class_header"] = values["class_header"].lower()
    if not values["served_model_name"]:
        problems.append("servedModelName: required (or set engine.servedModelName); "
                        "it is the model name clients send")
    if not values["tokenizer"]:
        problems.append("tokenizer: required (or set engine.model); a local folder or model id "
                        "whose tokenizer counts prompt tokens")
    if not values["engine_url"].startswith(("http://", "https://")):
        problems.append(f"engineUrl: {values['engine_url']!r} is not an http(s) URL; use e.g. http://127.0.0.1:8000")
    engine: EngineConfig | None = values["engine"]
    if engine is not None:
        if engine.block_size != values["block_size"]:
            problems.append(f"blockSize: {values['block_size']} differs from engine.blockSize {engine.block_size}; "
                            f"the guard's block arithmetic must match vLLM's, set both to the same value")
        context = values["max_context_tokens"]
        if context is not None and engine.max_model_len is not None and context > engine.max_model_len:
            problems.append(f"maxContextTokens: {values['max_context_tokens']} exceeds engine.maxModelLen "
                            f"{engine.max_model_len}; vLLM would refuse what the guard admits, "
                            f"lower maxContextTokens or raise engine.maxModelLen")
