"""``guard.json``: the one typed model of the guard's configuration.

The operator builds a ``GuardConfig`` from the InferenceService and renders it
with ``to_document``; the guard reads the file back with ``load``/``parse``.
Each field is declared once below, with its JSON key, its default and its
bounds, so writer and reader cannot drift (docs/guard-config.md documents the
fields; a contract test renders random valid specs and parses each). The models
are msgspec Structs (``typed.Model``, shared with the operator's API types).

The reader reports every problem at once, each naming the field and how to fix
it, because the file is usually written by a machine and read by a person only
when it is wrong.
"""
from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional

import msgspec
from msgspec import Meta

from .. import typed
from ..errors import ContractError
from ..tracing import TracingConfig
from .control_auth import ControlAuthConfig
from .engine_flags import extra_args_problems
from .kv_blocks import KV_EVENTS_ENDPOINT

OverLengthPolicy = Literal["Reject", "TruncateLeft"]
OVER_LENGTH_POLICIES = typing.get_args(OverLengthPolicy)
# Predicted: prompt + the mean output length the guard has learned (the ledger adds one
# margin for all requests in flight, at reservation_quantile_percent),
# grown while the answer streams past it. FullBudget: prompt + max_tokens (or
# the rest of the context), the worst case.
Reservation = Literal["Predicted", "FullBudget"]
RESERVATIONS = typing.get_args(Reservation)
# Objective: fewer requests run in vLLM at once while more would start later than the TTFT
# objective allows, while the replica is overloaded (ttft_limit.py). Off: max_concurrency is
# the only limit.
TtftControl = Literal["Objective", "Off"]
TTFT_CONTROLS = typing.get_args(TtftControl)
Runtime = Literal["vllm", "vllm-cpu"]
RUNTIMES = typing.get_args(Runtime)
PROXIED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
CLASS_HEADER = "x-gpufleet-class"
# The guard's bodyBudgetBytes when guard.json names none (the operator writes this default): some 28 bodies
# at the limit of a 128k-token context (admission/core.py's max_body_bytes), far more of a typical size.
DEFAULT_BODY_BUDGET_BYTES = 128 << 20  # about 3x in memory: well inside the guard container's 1Gi
# LowerOnly: the class header may ask for the route's default class or a lower
# priority (a higher level number), never a higher one. Trusted: any class, for
# a gateway in front that sets the header itself and drops the client's.
ClassHeaderPolicy = Literal["LowerOnly", "Trusted"]
CLASS_HEADER_POLICIES = typing.get_args(ClassHeaderPolicy)
# What one engine pod does in its service: unified serves whole requests; a disaggregated
# service's prefill pods compute prompts and hand their KV to its decode pods, which answer.
Role = Literal["unified", "prefill", "decode"]
ROLES = typing.get_args(Role)
# vLLM's --kv-transfer-config kv_role: producers write KV, consumers load it, kv_both does both.
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
# What vLLM does when loading KV from the connector fails: compute the prompt again, or fail it.
KVLoadFailurePolicy = Literal["recompute", "fail"]
# The file-based connector that works on vllm-cpu, and the extra_config key of its directory.
SHARED_STORAGE_CONNECTOR = "ExampleConnector"
SHARED_STORAGE_PATH_KEY = "shared_storage_path"
DEFAULT_SHARED_STORAGE_LIMIT_BYTES = 4 * 1024 ** 3
# The kv_role each disaggregated role needs: prefill pods write KV, decode pods load it.
KV_ROLES_BY_ROLE: dict[str, tuple[str, ...]] = {"prefill": ("kv_producer", "kv_both"),
                                                "decode": ("kv_consumer", "kv_both")}
UNKNOWN_FIELD = "unknown field; check the spelling against docs/guard-config.md"


class ConfigError(ContractError):
    """``guard.json`` is invalid; ``problems`` lists every field that is wrong."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid guard config:\n  - " + "\n  - ".join(problems))


class _Live:
    def __repr__(self) -> str:
        return "LIVE"


# A field marked LIVE: a running guard applies a new value when the file changes (``reload.py``);
# every other field (vLLM's engine section, the guard's layout) needs the pod restarted, and only
# those change the pod template.
LIVE = _Live()


@dataclass(frozen=True)
class FromEngine:
    """A field marked FromEngine(name): left out, it takes the engine section's field of that
    name (so a file with an ``engine`` section need not repeat it)."""
    field: str


class _Section(typed.Model, frozen=True, forbid_unknown_fields=True):
    pass


class QueueClass(_Section, frozen=True):
    name: str
    level: Annotated[int, Meta(ge=1)]  # 1 is served first
    max_queue_seconds: Annotated[float, Meta(gt=0)]


class SpeculativeConfig(_Section, frozen=True):
    model: str
    num_tokens: Annotated[int, Meta(ge=1)] = 5


class KVTransferConfig(_Section, frozen=True):
    """vLLM's KV connector (``--kv-transfer-config``): how KV moves between engines."""
    connector: str  # vLLM's kv_connector: NixlConnector, ExampleConnector, LMCacheConnectorV1
    role: KVRole = "kv_both"
    extra_config: Mapping[str, str] = msgspec.field(default_factory=dict)  # kv_connector_extra_config
    load_failure_policy: KVLoadFailurePolicy = "recompute"
    # ExampleConnector only: the guard of a pod that writes KV files removes the oldest prompts'
    # files past this many bytes in shared_storage_path (the connector never removes any).
    shared_storage_limit_bytes: Annotated[int, Meta(ge=1)] = DEFAULT_SHARED_STORAGE_LIMIT_BYTES


class KVEventsConfig(_Section, frozen=True):
    """vLLM's KV events (``--kv-events-config``), which the guard follows to tell the router what the
    prefix cache holds (kv_blocks.py). ``endpoint``: vLLM's ZMQ publisher address (the guard binds it,
    or connects where vLLM binds: ipc:// and wildcard addresses); ``topic``: vLLM's topic."""
    endpoint: str = KV_EVENTS_ENDPOINT
    topic: str = ""


class LoraConfig(_Section, frozen=True):
    """LoRA adapters on this engine (spec.engine.lora): vLLM's ``--enable-lora`` and its capacity.
    Adapters themselves are not listed here: the operator places them on replicas at run time
    (``PUT /adapters``, contract/adapters.py) and the guard loads them through vLLM's runtime API."""
    max_loras: Annotated[int, Meta(ge=1)] = 4          # --max-loras: adapters in one batch (GPU slots)
    max_lora_rank: Annotated[int, Meta(ge=1)] = 16     # --max-lora-rank
    max_cpu_loras: Optional[Annotated[int, Meta(ge=1)]] = None  # --max-cpu-loras; None: vLLM's (= max_loras)
    # The most adapters this replica holds at once (PUT /adapters refuses more); also the bound
    # on the ``adapter`` label of the guard's per-adapter series.
    max_adapters: Annotated[int, Meta(ge=1, le=256)] = 32


# Bounds of one adapter's fetch (``adapters`` below) when the operator does not set them.
DEFAULT_ADAPTER_MAX_BYTES = 2 * 1024 ** 3
DEFAULT_ADAPTER_MAX_MEMBERS = 10_000
DEFAULT_ADAPTER_FETCH_SECONDS = 600.0


class AdapterFetchConfig(_Section, frozen=True):
    """Bounds on fetching one adapter (``PUT /adapters``' sources are untrusted input): the bytes
    downloaded and the bytes extracted (each at most ``max_bytes``; the operator sets the adapter's
    share of engine.lora.adapterStorage), the files and folders of an archive or a Hub snapshot, one
    deadline for the whole fetch, and whether a ``uri`` may name a loopback, link-local, private,
    unspecified or multicast address (the platform admin's choice; off by default)."""
    max_bytes: Annotated[int, Meta(ge=1)] = DEFAULT_ADAPTER_MAX_BYTES
    max_members: Annotated[int, Meta(ge=1)] = DEFAULT_ADAPTER_MAX_MEMBERS
    fetch_timeout_seconds: Annotated[float, Meta(gt=0)] = DEFAULT_ADAPTER_FETCH_SECONDS
    allow_private_sources: bool = False


class EngineConfig(_Section, frozen=True):
    model: str
    runtime: Runtime = "vllm"
    served_model_name: str = ""  # empty: the model
    host: str = "0.0.0.0"
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    # None: the model's own context (vLLM reads it from the model's config); the guard then
    # learns it from vLLM's /v1/models before it admits anything.
    max_model_len: Optional[Annotated[int, Meta(ge=1)]] = None
    # The model repository's revision (branch, tag or commit): --revision and --tokenizer-revision.
    revision: Optional[str] = None
    tensor_parallel_size: Annotated[int, Meta(ge=1)] = 1
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = 0.9
    block_size: Annotated[int, Meta(ge=1)] = 32
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: Annotated[int, Meta(ge=1)] = 256
    max_num_batched_tokens: Optional[Annotated[int, Meta(ge=1)]] = None  # None: vLLM's own choice
    quantization: Optional[str] = None
    speculative: Optional[SpeculativeConfig] = None
    num_gpu_blocks_override: Optional[Annotated[int, Meta(ge=2)]] = None
    cpu_kv_cache_space_gib: Optional[Annotated[int, Meta(ge=1)]] = msgspec.field(default=None,
                                                                                 name="cpuKvCacheSpaceGiB")
    kv_transfer: Optional[KVTransferConfig] = None
    kv_events: Optional[KVEventsConfig] = None   # None: vLLM publishes no KV events
    lora: Optional[LoraConfig] = None
    extra_args: Annotated[tuple[str, ...], Meta(examples=['["--enforce-eager"]'])] = ()


class SLOConfig(_Section, frozen=True):
    """The service's objectives, against which the guard counts each request good or bad
    (``gpufleet_guard_sli_*``): burn rates then need no histogram bucket at the objective."""
    ttft_p99_seconds: Annotated[float, Meta(gt=0)] = 2.0
    itl_p99_seconds: Annotated[float, Meta(gt=0)] = 0.1
    # Non-streaming requests: their whole answer is their first token.
    request_p99_seconds: Annotated[float, Meta(gt=0)] = 60.0


def _default_classes() -> tuple[QueueClass, ...]:
    return (QueueClass("interactive", 1, 2), QueueClass("standard", 2, 10), QueueClass("background", 3, 60))


def default_routes(classes: tuple[QueueClass, ...] | list[QueueClass]) -> dict[str, str]:
    """Chat to the first level, completions to level 2 (else the first), embeddings to the last."""
    by_level = sorted(classes, key=lambda c: (c.level, c.name))
    first, last = by_level[0].name, by_level[-1].name
    middle = next((c.name for c in by_level if c.level == 2), first)
    return {"/v1/chat/completions": first, "/v1/completions": middle, "/v1/embeddings": last}


class GuardConfig(_Section, frozen=True):
    served_model_name: Annotated[str, FromEngine("served_model_name")] = ""
    tokenizer: Annotated[str, FromEngine("model")] = ""
    tokenizer_revision: Annotated[Optional[str], FromEngine("revision")] = None
    service: str = ""
    namespace: str = ""
    role: Role = "unified"
    listen_host: str = "0.0.0.0"
    listen_port: Annotated[int, Meta(ge=0, le=65535)] = 8080
    # The Unix socket of what only the pod itself calls (POST /drain from its preStop hook,
    # control_auth.py); empty: none, and nothing can start a drain but SIGTERM.
    admin_socket: str = ""
    engine_url: str = "http://127.0.0.1:8000"
    block_size: Annotated[int, Meta(ge=1), FromEngine("block_size")] = 32
    kv_watermark_percent: Annotated[int, Meta(ge=0, le=99), LIVE] = 5
    reservation: Annotated[Reservation, LIVE] = "Predicted"
    reservation_quantile_percent: Annotated[int, Meta(ge=50, le=100), LIVE] = 90
    # None: the context vLLM serves (engine.maxModelLen, or what vLLM's /v1/models reports).
    max_context_tokens: Annotated[Optional[Annotated[int, Meta(ge=1)]], FromEngine("max_model_len"), LIVE] = None
    over_length_policy: Annotated[OverLengthPolicy, LIVE] = "Reject"
    request_timeout_seconds: Annotated[float, Meta(gt=0), LIVE] = 300
    drain_timeout_seconds: Annotated[float, Meta(ge=0), LIVE] = 300
    max_concurrency: Annotated[int, Meta(ge=1), LIVE] = 64
    ttft_control: Annotated[TtftControl, LIVE] = "Objective"
    max_queue_length: Annotated[int, Meta(ge=0), LIVE] = 1024
    class_header: Annotated[str, LIVE] = CLASS_HEADER
    class_header_policy: Annotated[ClassHeaderPolicy, LIVE] = "LowerOnly"
    aging_seconds: Annotated[float, Meta(gt=0), LIVE] = 5
    retry_after_seconds: Annotated[float, Meta(gt=0), LIVE] = 1
    # Request-body bytes held at once across the guard's requests (gpufleet_kit.body_budget); more: 503.
    body_budget_bytes: Annotated[int, Meta(ge=1), LIVE] = DEFAULT_BODY_BUDGET_BYTES
    queue_classes: Annotated[tuple[QueueClass, ...], Meta(min_length=1), LIVE] = msgspec.field(
        default_factory=_default_classes)
    # Routes left out get default_routes(queue_classes).
    default_class_by_route: Annotated[Mapping[str, str], LIVE] = msgspec.field(default_factory=dict)
    metrics_poll_seconds: Annotated[float, Meta(gt=0), LIVE] = 0.5
    slo: Annotated[SLOConfig, LIVE] = msgspec.field(default_factory=SLOConfig)
    adapters: Annotated[AdapterFetchConfig, LIVE] = msgspec.field(default_factory=AdapterFetchConfig)
    # Who may call the control routes (control_auth.py); None: nobody, each gets 401.
    control_auth: Annotated[Optional[ControlAuthConfig], LIVE] = None
    # Where the guard (and, with engineSpans, vLLM) sends spans; None: no tracing (docs/tracing.md).
    tracing: Optional[TracingConfig] = None
    engine: Optional[EngineConfig] = None

    def queue_class(self, name: str) -> QueueClass | None:
        return next((c for c in self.queue_classes if c.name == name), None)

    def classes_allowed(self, route: str) -> tuple[QueueClass, ...]:
        """The classes a request on ``route`` may ask for with the class header."""
        if self.class_header_policy == "Trusted":
            return self.queue_classes
        floor = self.queue_class(self.default_class_by_route[route])
        return tuple(c for c in self.queue_classes if floor is None or c.level >= floor.level)


def _markers() -> dict[str, tuple]:
    hints = typing.get_type_hints(GuardConfig, include_extras=True)
    return {name: getattr(hint, "__metadata__", ()) for name, hint in hints.items()}


_MARKERS = _markers()
LIVE_FIELDS = tuple(name for name, marks in _MARKERS.items() if any(m is LIVE for m in marks))
FROM_ENGINE = {name: m.field for name, marks in _MARKERS.items() for m in marks if isinstance(m, FromEngine)}
_KEYS = {f.name: f.encode_name for f in msgspec.structs.fields(GuardConfig)}
# Read once: msgspec.structs.fields evaluates the class's annotations on every call (about a
# millisecond), and the operator hashes the restart fields of every pool on every apply.
_LIVE_KEYS = frozenset(_KEYS[name] for name in LIVE_FIELDS)


# --- writing ---------------------------------------------------------------------------


def key_of(f: msgspec.structs.FieldInfo) -> str:
    """The JSON key of a field (``msgspec.structs.fields(GuardConfig)``)."""
    return f.encode_name


def to_document(config: GuardConfig) -> dict:
    """The JSON document for ``config``: every field, so the ConfigMap shows what the guard runs with."""
    return typed.to_builtins(config)


def render(config: GuardConfig) -> str:
    return json.dumps(to_document(config), indent=2, sort_keys=True)


def restart_document(config: GuardConfig) -> dict:
    """The part of the document a running pod cannot take without a restart: vLLM's ``engine``
    section and the guard's layout (addresses, model, tokenizer). The operator hashes only this
    into the pod template; the ``live`` fields the guard re-reads from the mounted file."""
    return {k: v for k, v in to_document(config).items() if k not in _LIVE_KEYS}


def restart_changes(running: GuardConfig, new: GuardConfig) -> list[str]:
    """Keys of the fields that differ between ``running`` and ``new`` and need a restart."""
    return sorted(key for name, key in _KEYS.items()
                  if key not in _LIVE_KEYS and getattr(running, name) != getattr(new, name))


def live_changes(running: GuardConfig, new: GuardConfig) -> list[str]:
    """Keys of the live fields that differ between ``running`` and ``new``."""
    return sorted(key for name, key in _KEYS.items()
                  if key in _LIVE_KEYS and getattr(running, name) != getattr(new, name))


def with_live_fields(running: GuardConfig, new: GuardConfig) -> GuardConfig:
    """``running`` with the live fields of ``new``, checked together as one file (a new
    maxContextTokens must still fit the engine the guard runs with)."""
    merged = msgspec.structs.replace(running, **{name: getattr(new, name) for name in LIVE_FIELDS})
    return parse(to_document(merged))


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
    config, found = typed.salvage(GuardConfig, raw, unknown=UNKNOWN_FIELD)
    problems = [str(p) if p.loc else f"guard.json: {p.message}" for p in found]
    if config is None:
        raise ConfigError(problems)
    config = _completed(config, raw)
    if config.engine is not None:
        problems += _engine_problems(config.engine, "engine")
    problems += _guard_problems(config)
    if problems:
        raise ConfigError(problems)
    return config


def _completed(config: GuardConfig, raw: Any) -> GuardConfig:
    """The fields left to other fields filled in: the engine's served name (its model), the
    FromEngine fields, the routes left out, the class header in lower case."""
    engine = config.engine
    changes: dict[str, Any] = {"class_header": config.class_header.lower()}
    if engine is not None:
        if not engine.served_model_name:
            engine = changes["engine"] = msgspec.structs.replace(engine, served_model_name=engine.model)
        given = raw if isinstance(raw, dict) else {}
        changes.update({name: getattr(engine, source) for name, source in FROM_ENGINE.items()
                        if given.get(_KEYS[name]) is None})
    if config.queue_classes:
        changes["default_class_by_route"] = {**default_routes(config.queue_classes),
                                             **config.default_class_by_route}
    return msgspec.structs.replace(config, **changes)


# --- checks across fields --------------------------------------------------------------


def _engine_problems(e: EngineConfig, where: str) -> list[str]:
    problems = []
    if e.runtime == "vllm-cpu" and e.block_size % 32:
        problems.append(f"{where}.blockSize: {e.block_size} is not a multiple of 32, which vLLM's CPU "
                        f"backend requires; use 32")
    blocks, block_size, max_model_len = e.num_gpu_blocks_override, e.block_size, e.max_model_len
    if blocks is not None and max_model_len is not None and max_model_len > (blocks - 1) * block_size:
        # vLLM keeps one block back and refuses to start when one request of
        # maxModelLen tokens cannot fit in the rest.
        problems.append(f"{where}.maxModelLen: {max_model_len} tokens do not fit in numGpuBlocksOverride "
                        f"{blocks} blocks of {block_size} (vLLM keeps one block back); lower maxModelLen "
                        f"to at most {(blocks - 1) * block_size} or raise numGpuBlocksOverride")
    for _, problem in extra_args_problems(e.extra_args):
        problems.append(f"{where}.extraArgs: {problem}")
    lora = e.lora
    if lora is not None and lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        # vLLM refuses to start: its CPU cache holds every adapter of a batch.
        problems.append(f"{where}.lora.maxCpuLoras: {lora.max_cpu_loras} is below maxLoras {lora.max_loras}; "
                        f"vLLM's CPU-side cache must hold at least the adapters of one batch")
    if e.kv_events is not None and not e.enable_prefix_caching:
        # vLLM publishes block events only from its prefix cache.
        problems.append(f"{where}.kvEvents: set, but enablePrefixCaching is false: vLLM publishes no block "
                        f"events without its prefix cache; remove kvEvents or enable prefix caching")
    if e.kv_events is not None and not e.kv_events.endpoint.startswith(("tcp://", "ipc://")):
        problems.append(f"{where}.kvEvents.endpoint: {e.kv_events.endpoint!r} is not a ZMQ tcp:// or ipc:// "
                        f"address; use {KV_EVENTS_ENDPOINT!r}")
    kv = e.kv_transfer
    if kv is not None and kv.connector == SHARED_STORAGE_CONNECTOR:
        path = kv.extra_config.get(SHARED_STORAGE_PATH_KEY, "")
        if not path.startswith("/"):
            # vLLM would default to /tmp, which the guard bounds by removing the oldest prompts.
            problems.append(f"{where}.kvTransfer.extraConfig.{SHARED_STORAGE_PATH_KEY}: "
                            f"{SHARED_STORAGE_CONNECTOR} needs the absolute path of a directory that "
                            f"the service's pods share and nothing else uses, got {path!r}")
    return problems


def _guard_problems(config: GuardConfig) -> list[str]:
    problems = []
    names = [c.name for c in config.queue_classes]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"queueClasses: class {dup!r} appears twice; class names must be unique")
    for route, name in config.default_class_by_route.items():
        if route not in PROXIED_ROUTES:
            problems.append(f"defaultClassByRoute: unknown route {route!r}; routes are {', '.join(PROXIED_ROUTES)}")
        if name not in names:
            problems.append(f"defaultClassByRoute[{route!r}]: class {name!r} is not in queueClasses "
                            f"({', '.join(sorted(names))}); add it there or name an existing class")
    if not config.served_model_name:
        problems.append("servedModelName: required (or set engine.servedModelName); "
                        "it is the model name clients send")
    if not config.tokenizer:
        problems.append("tokenizer: required (or set engine.model); a local folder or model id "
                        "whose tokenizer counts prompt tokens")
    if not config.engine_url.startswith(("http://", "https://")):
        problems.append(f"engineUrl: {config.engine_url!r} is not an http(s) URL; use e.g. http://127.0.0.1:8000")
    engine = config.engine
    if engine is not None and config.role in KV_ROLES_BY_ROLE:
        wanted = KV_ROLES_BY_ROLE[config.role]
        if engine.kv_transfer is None:
            problems.append(f"engine.kvTransfer: required with role {config.role!r}; a {config.role} pod "
                            f"hands KV over through vLLM's KV connector (kvTransfer.role {' or '.join(wanted)})")
        elif engine.kv_transfer.role not in wanted:
            problems.append(f"engine.kvTransfer.role: {engine.kv_transfer.role!r} does not fit role "
                            f"{config.role!r}; use {' or '.join(wanted)}")
    if engine is not None:
        if engine.block_size != config.block_size:
            problems.append(f"blockSize: {config.block_size} differs from engine.blockSize {engine.block_size}; "
                            f"the guard's block arithmetic must match vLLM's, set both to the same value")
        context = config.max_context_tokens
        if context is not None and engine.max_model_len is not None and context > engine.max_model_len:
            problems.append(f"maxContextTokens: {context} exceeds engine.maxModelLen "
                            f"{engine.max_model_len}; vLLM would refuse what the guard admits, "
                            f"lower maxContextTokens or raise engine.maxModelLen")
    return problems
