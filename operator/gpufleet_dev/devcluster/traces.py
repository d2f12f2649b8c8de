"""The local cluster's trace store: Jaeger (v1.75.0, built from the Go module proxy by binaries.py)
as a local process, OTLP in and its query API out (docs/tracing.md).

Jaeger's all-in-one binary is an OpenTelemetry Collector; its configuration here keeps what the
cluster uses (the OTLP receivers, in-memory storage, the query API and UI, a health check) on the
ports ``JaegerPorts`` names, so nothing else it would open (Zipkin, Jaeger's own receivers, remote
sampling, its metrics) can collide with another component.
"""
from __future__ import annotations

import json
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

# The ports a guard, the router and the tests reach Jaeger on: OpenTelemetry's and Jaeger's defaults.
OTLP_GRPC_PORT = 4317
OTLP_HTTP_PORT = 4318
QUERY_PORT = 16686
# Traces the in-memory store holds; older ones are dropped.
MAX_TRACES = 50_000


@dataclass(frozen=True)
class JaegerPorts:
    otlp_grpc: int = OTLP_GRPC_PORT
    otlp_http: int = OTLP_HTTP_PORT
    query: int = QUERY_PORT
    query_grpc: int = 16685
    health: int = 13133


def config(ports: JaegerPorts, host: str = "127.0.0.1") -> dict:
    """Jaeger's collector configuration (YAML is a superset of JSON: written as JSON)."""
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query", "healthcheckv2"],
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                     "exporters": ["jaeger_storage_exporter"]}},
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
        },
        "extensions": {
            # Not Jaeger's own traces: they would go to an OTLP endpoint of its default, which nothing
            # serves, and its stop would wait 10 s for that exporter to give up.
            "jaeger_query": {"storage": {"traces": "memstore"}, "enable_tracing": False,
                             "http": {"endpoint": f"{host}:{ports.query}"},
                             "grpc": {"endpoint": f"{host}:{ports.query_grpc}"}},
            "jaeger_storage": {"backends": {"memstore": {"memory": {"max_traces": MAX_TRACES}}}},
            "healthcheckv2": {"use_v2": True, "http": {"endpoint": f"{host}:{ports.health}"}},
        },
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"{host}:{ports.otlp_grpc}"},
                                             "http": {"endpoint": f"{host}:{ports.otlp_http}"}}}},
        "processors": {"batch": {"timeout": "200ms"}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}},
    }


def argv(binary: Path, config_path: Path) -> list[str]:
    return [str(binary), f"--config=file:{config_path}"]


def write_config(path: Path, ports: JaegerPorts, host: str = "127.0.0.1") -> Path:
    path.write_text(json.dumps(config(ports, host), indent=2))
    return path


def otlp_http_endpoint(ports: JaegerPorts, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{ports.otlp_http}"


def query_url(ports: JaegerPorts, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{ports.query}"


def ready(ports: JaegerPorts, host: str = "127.0.0.1") -> bool:
    """Jaeger's query API answers (its service list)."""
    try:
        with urllib.request.urlopen(f"{query_url(ports, host)}/api/services", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def trace(ports: JaegerPorts, trace_id: str, host: str = "127.0.0.1") -> dict | None:
    """One trace from Jaeger's query API (``/api/traces/<id>``): its spans and processes, None when
    Jaeger has none by that id."""
    return read_trace(query_url(ports, host), trace_id)


def read_trace(query: str, trace_id: str) -> dict | None:
    """``trace`` from the query API at ``query`` (``http://host:16686``)."""
    try:
        with urllib.request.urlopen(f"{query}/api/traces/{trace_id}", timeout=5) as r:
            data = json.loads(r.read()).get("data") or []
    except OSError:
        return None
    return data[0] if data else None


def state(ports: JaegerPorts, host: str = "127.0.0.1") -> dict:
    """What cluster.py records in its state file: the ports and the addresses others use (the
    operator's --otlp-endpoint is ``otlpHttp``)."""
    return {"ports": asdict(ports), "otlpHttp": otlp_http_endpoint(ports, host), "query": query_url(ports, host)}


def search(ports: JaegerPorts, service: str, limit: int = 100, host: str = "127.0.0.1",
           tags: Mapping[str, str] | None = None) -> list[dict]:
    """The latest traces with a span of ``service`` (Jaeger's ``/api/traces?service=``), only those with a
    span carrying each of ``tags``."""
    return find_traces(query_url(ports, host), service, limit=limit, tags=tags)


def find_traces(query: str, service: str, *, limit: int = 100, tags: Mapping[str, str] | None = None,
                operation: str | None = None, window: tuple[float, float] | None = None) -> list[dict]:
    """``search`` from the query API at ``query``; ``operation``: only traces with a span of that name;
    ``window``: only traces with a span that began between these unix times. Empty when Jaeger does not
    answer."""
    params = {"service": service, "limit": str(limit), **({"tags": json.dumps(dict(tags))} if tags else {}),
              **({"operation": operation} if operation else {}),
              **({"start": str(int(window[0] * 1e6)), "end": str(int(window[1] * 1e6))} if window else {})}
    try:
        with urllib.request.urlopen(f"{query}/api/traces?{urllib.parse.urlencode(params)}", timeout=30) as r:
            return json.loads(r.read()).get("data") or []
    except OSError:
        return []
