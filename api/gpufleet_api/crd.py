"""The CustomResourceDefinition, generated from the API types."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import yaml

from . import schema
from . import v1alpha1 as t
from .tenants import usage as tenancy
from .tenants.declaration import TenantsSpec


def _strip_status_defaults(schema: dict) -> dict:
    """Status is observed, never defaulted: drop defaults the kit adds."""
    schema = copy.deepcopy(schema)

    def walk(s):
        s.pop("default", None)
        for p in s.get("properties", {}).values():
            walk(p)
        if "items" in s:
            walk(s["items"])
    walk(schema)
    return schema


# Both kinds' Ready condition and its reason.
READY_COLUMNS: list[dict] = [
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
     "description": "Ready condition"},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
     "description": "Why Ready is what it is"},
]

PRINTER_COLUMNS: list[dict] = [
    *READY_COLUMNS,
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready replicas"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas",
     "description": "Replicas the operator wants"},
    {"name": "KV%", "type": "integer", "jsonPath": ".status.kvCacheUsagePercent",
     "description": "Mean KV-cache usage"},
    {"name": "P99-TTFT(ms)", "type": "integer", "jsonPath": ".status.ttftP99Milliseconds",
     "description": "Observed p99 time to first token"},
    {"name": "Frag%", "type": "integer", "jsonPath": ".status.fragmentation.percent",
     "description": "Worst replica's GPU memory fragmentation: inactive split / reserved bytes of vLLM's allocator"},
    {"name": "Canary%", "type": "integer", "jsonPath": ".status.rollout.canaryWeightPercent",
     "description": "Share of new requests the router sends to the canary revision (spec.rollout Canary)"},
    {"name": "Rollout", "type": "string", "jsonPath": ".status.rollout.phase",
     "description": "Where the canary rollout stands: Progressing, Paused, Promoting, Promoted, RolledBack, Aborted"},
    {"name": "Prefill", "type": "integer", "jsonPath": '.status.pools[?(@.role=="prefill")].readyReplicas',
     "priority": 1, "description": "Ready replicas of the prefill pool (spec.disaggregation)"},
    {"name": "Decode", "type": "integer", "jsonPath": '.status.pools[?(@.role=="decode")].readyReplicas',
     "priority": 1, "description": "Ready replicas of the decode pool (spec.disaggregation)"},
    {"name": "KVWaste%", "type": "integer", "jsonPath": ".status.kvWastePercent", "priority": 1,
     "description": "Share of the KV blocks in use holding no token"},
    {"name": "Figures", "type": "date", "jsonPath": ".status.figuresUpdateTime", "priority": 1,
     "description": "When KV%, P99-TTFT(ms) and KVWaste% last changed (written at most every "
                    "--status-figures-interval-seconds)"},
    {"name": "Gateway", "type": "string", "jsonPath": '.status.conditions[?(@.type=="GatewayReady")].reason',
     "priority": 1, "description": "spec.gateway: Accepted once a gateway took the InferencePool, else why not"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
    {"name": "Isolation", "type": "string", "jsonPath": ".spec.isolation.mode", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


ADAPTER_PRINTER_COLUMNS: list[dict] = [
    {"name": "Service", "type": "string", "jsonPath": ".spec.service", "description": "The base InferenceService"},
    *READY_COLUMNS,
    {"name": "Loaded", "type": "integer", "jsonPath": ".status.loadedReplicas",
     "description": "Replicas that have the adapter loaded"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas",
     "description": "Replicas the operator placed the adapter on"},
    {"name": "RPS", "type": "string", "jsonPath": ".status.requestsPerSecond", "priority": 1,
     "description": "Requests per second for the adapter over the last minute"},
    {"name": "Figures", "type": "date", "jsonPath": ".status.figuresUpdateTime", "priority": 1,
     "description": "When RPS last changed (written at most every --status-figures-interval-seconds)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


@dataclass(frozen=True)
class Kind:
    """One CustomResourceDefinition: its names, types and columns."""
    kind: str
    plural: str
    singular: str
    short_names: list[str]
    spec: type
    status: type | None  # None: a declaration nobody writes a status for
    description: str
    columns: list[dict]
    subresources: dict
    metadata_schema: dict = field(default_factory=lambda: {"type": "object"})
    # CEL rules on the whole object: the only place a rule may read metadata.name.
    validations: list[dict] = field(default_factory=list)


SERVICE = Kind(
    t.KIND, t.PLURAL, t.SINGULAR, t.SHORT_NAMES, t.InferenceServiceSpec, t.InferenceServiceStatus,
    "An LLM served by vLLM engines on dedicated GPUs behind an admission guard, "
    "autoscaled on KV-cache watermarks and audited for fragmentation and isolation.",
    PRINTER_COLUMNS,
    {"status": {}, "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                             "labelSelectorPath": ".status.selector"}})
ADAPTER = Kind(
    t.ADAPTER_KIND, t.ADAPTER_PLURAL, t.ADAPTER_SINGULAR, t.ADAPTER_SHORT_NAMES, t.InferenceAdapterSpec,
    t.InferenceAdapterStatus,
    "A LoRA adapter served on an InferenceService's base model: fetched and loaded by the replicas' "
    "guards at run time, on as many replicas as its traffic needs, and routed by `model: <name>`.",
    ADAPTER_PRINTER_COLUMNS, {"status": {}},
    # The name is what clients send as `model`, a folder name and a metric label.
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 63, "pattern": t.DNS_LABEL}}})
TENANTS_PRINTER_COLUMNS: list[dict] = [
    {"name": "Identity", "type": "string", "jsonPath": ".spec.identity",
     "description": "How callers are identified: Keys (Bearer keys) or Trusted (a gateway's header)"},
    {"name": "Tenants", "type": "string", "jsonPath": ".spec.tenants[*].name", "description": "The tenants' names"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
TENANTS_NAME_MESSAGE = (f"one declaration per namespace: name it {tenancy.TENANTS_NAME} "
                        f"(metadata.name: {tenancy.TENANTS_NAME}); the router reads no other")
TENANTS = Kind(
    tenancy.TENANTS_KIND, tenancy.TENANTS_PLURAL, tenancy.TENANTS_SINGULAR, [tenancy.TENANTS_NAME], TenantsSpec,
    None,
    "The tenants of a namespace, for every InferenceService and InferenceAdapter in it: who is asking (API "
    "keys or a trusted gateway's header), the limits each may use, and its fair-share weight "
    f"(docs/tenants.md). One per namespace, named {tenancy.TENANTS_NAME}.",
    TENANTS_PRINTER_COLUMNS, {},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 253}}},
    [schema.rule(f"self.metadata.name == '{tenancy.TENANTS_NAME}'", TENANTS_NAME_MESSAGE,
                 field_path=".metadata.name")])
KINDS = {k.kind: k for k in (SERVICE, ADAPTER, TENANTS)}


def crd_file_name(kind: Kind = SERVICE) -> str:
    return f"{kind.plural}.{t.GROUP}.yaml"


def build_crd(kind: Kind = SERVICE) -> dict:
    properties = {
        "apiVersion": {"type": "string", "description": "API version of this object."},
        "kind": {"type": "string", "description": "Kind of this object."},
        "metadata": kind.metadata_schema,
        "spec": schema.openapi(kind.spec),
    }
    if kind.status is not None:
        properties["status"] = _strip_status_defaults(schema.openapi(kind.status))
    root: dict[str, Any] = {"type": "object", "description": kind.description, "required": ["spec"],
                            "properties": properties}
    if kind.validations:
        root["x-kubernetes-validations"] = kind.validations
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{t.GROUP}",
                     "labels": {"app.kubernetes.io/part-of": "gpufleet"}},
        "spec": {
            "group": t.GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind.kind, "listKind": f"{kind.kind}List", "plural": kind.plural,
                      "singular": kind.singular, "shortNames": kind.short_names,
                      "categories": ["gpufleet", "all"]},
            "versions": [{
                "name": t.VERSION, "served": True, "storage": True,
                "subresources": kind.subresources,
                "additionalPrinterColumns": kind.columns,
                "schema": {"openAPIV3Schema": root},
            }],
        },
    }


def render_yaml(kind: Kind = SERVICE) -> str:
    source = "api/gpufleet_api/tenants/declaration.py" if kind is TENANTS else "api/gpufleet_api/v1alpha1/"
    header = f"# Generated from {source} by `gpufleet crd`. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(kind), sort_keys=False, width=100)


def _default_text(default: Any) -> str:
    """A default as the field table shows it: a list of objects item by item; a long object not at
    all (its fields have their own rows)."""
    if default and isinstance(default, list) and all(isinstance(d, dict) for d in default):
        return "<br>".join("`" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "`" for d in default)
    if default is None or isinstance(default, (dict, list)) and len(str(default)) > 40:
        return ""
    return f"`{default}`"


def _tables(kind: Kind) -> tuple[list[str], list[str], list[str]]:
    """(spec rows, status rows, CEL rule lines) of a kind's field reference."""
    whole = build_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    root = whole["properties"]
    rows: list[str] = []

    def walk(schema: dict, path: str) -> None:
        for name, sub in schema.get("properties", {}).items():
            p = f"{path}.{name}"
            kind = sub.get("type", "int-or-string")
            if kind == "array" and sub.get("items", {}).get("type") == "object":
                kind = "[]object"
            default_s = _default_text(sub.get("default"))
            extra = f" One of: {', '.join(map(str, sub['enum']))}." if "enum" in sub else ""
            desc = " ".join(sub.get("description", "").split()) + extra
            rows.append(f"| `{p}` | {kind} | {default_s} | {desc} |")
            if "properties" in sub:
                walk(sub, p)
            elif sub.get("items", {}).get("properties"):
                walk(sub["items"], p + "[]")
    walk(root["spec"], "spec")
    status_rows: list[str] = []

    def walk_status(schema: dict, path: str) -> None:
        for name, sub in schema.get("properties", {}).items():
            p = f"{path}.{name}"
            kind = sub.get("type", "int-or-string")
            if kind == "array" and sub.get("items", {}).get("type") == "object":
                kind = "[]object"
            status_rows.append(f"| `{p}` | {kind} | {' '.join(sub.get('description', '').split())} |")
            if "properties" in sub:
                walk_status(sub, p)
            elif sub.get("items", {}).get("properties"):
                walk_status(sub["items"], p + "[]")
    walk_status(root.get("status", {}), "status")
    # Rules on the whole object (they read metadata) are named by the field they are about.
    rules = [f"- `{r['fieldPath'].lstrip('.')}`: {r['message']}" for r in whole.get("x-kubernetes-validations", [])]

    def collect(schema: dict, path: str) -> None:
        for r in schema.get("x-kubernetes-validations", []):
            rules.append(f"- `{path}`: {r['message']}")
        for name, sub in schema.get("properties", {}).items():
            collect(sub, f"{path}.{name}")
        if "items" in schema:
            collect(schema["items"], path + "[]")
    collect(root["spec"], "spec")
    return rows, status_rows, rules


def render_markdown() -> str:
    """docs/api.md: every spec field with type, default and description, of every kind."""
    rows, status_rows, rules = _tables(SERVICE)
    adapter_rows, adapter_status_rows, adapter_rules = _tables(ADAPTER)
    tenants_rows, _, tenants_rules = _tables(TENANTS)
    return "\n".join([
        "# InferenceService API (serving.gpufleet.dev/v1alpha1)", "",
        "Generated from `api/gpufleet_api/v1alpha1/` (`gpufleet crd --markdown`); "
        "`kubectl explain inferenceservice.spec --recursive` shows the same descriptions. The types are "
        "msgspec Structs, the kit `guard.json` uses too (docs/guard-config.md says why msgspec).", "",
        "Numbers follow the API conventions: integer percentages (`kvWatermarkPercent: 5`), durations as "
        "`...Seconds`/`...Milliseconds` integers, string enums, references as `...Ref`.", "",
        "| field | type | default | description |", "|---|---|---|---|", *rows, "",
        "## Status (written by the operator)", "",
        "| field | type | description |", "|---|---|---|", *status_rows, "",
        "## Cross-field rules (checked by the API server)", "", *rules, "",
        "## Checked by the operator (reported as `Ready=False, reason=InvalidSpec`)", "",
        "- `spec.engine.extraArgs` may not set flags gpufleet manages (port, model, parallelism, KV and "
        "batching); the message names the typed field to use instead.",
        "- `spec.engine.extraArgs` may not carry a credential (`--api-key`, `--hf-token`: it would be written "
        "in plain text into guard.json, the guard ConfigMap and vLLM's logged command line; the token goes "
        "in `spec.model.source.huggingFace.credentialsSecretRef`), nor set what the pod and the guard cannot "
        "account for: data parallelism (`--data-parallel-*`, `-dp`; scale with replicas), pipeline and "
        "context parallelism (`-pp`, `-pcp`, `-dcp`), several nodes (`--nnodes`, `--node-rank`, "
        "`--headless`), `--kv-cache-memory-bytes` (set `gpuMemoryUtilizationPercent` or "
        "`kvCache.numBlocksOverride`), `--config`, and vLLM's listener (`--uds`, `--grpc`, "
        "`--ssl-keyfile`, `--ssl-certfile`). Abbreviations (`--api-k`), `--flag_name`, `--flag=value` and "
        "`--flag.key` count as the flag; an entry that is not a flag must follow a flag that takes it.",
        "- `spec.engine.runtime: vllm-cpu` serves unquantized weights with `kvCache.dtype: auto` only.", "",
        "# InferenceAdapter API (serving.gpufleet.dev/v1alpha1)", "",
        "A LoRA adapter on an InferenceService's base model (`kubectl get iad`). Its `metadata.name` is what "
        "clients send as `model`, so it must be a DNS label (at most 63 lowercase letters, digits and '-').", "",
        "| field | type | default | description |", "|---|---|---|---|", *adapter_rows, "",
        "## Status (written by the operator)", "",
        "| field | type | description |", "|---|---|---|", *adapter_status_rows, "",
        "## Rules (checked by the API server)", "", *adapter_rules, "",
        f"# {TENANTS.kind} API ({t.GROUP}/{t.VERSION})", "",
        f"The tenants of a namespace (`kubectl get {TENANTS.short_names[0]}`), generated from "
        "`api/gpufleet_api/tenants/declaration.py`: one object per namespace, named "
        f"`{tenancy.TENANTS_NAME}`, for every InferenceService and InferenceAdapter in it (docs/tenants.md). "
        "It has no status: the router reads it and reports what it refuses in its log and metrics.", "",
        "| field | type | default | description |", "|---|---|---|---|", *tenants_rows, "",
        "## Rules (checked by the API server)", "",
        "- `spec.tenants`: each name once (a list keyed by `name`).", *tenants_rules, ""])
