"""The endpoint picker's gRPC server beside the router's HTTP server, in the same process and event loop:
Envoy's ExternalProcessor (service.py) and the standard gRPC health service (grpc.health.v1) the gateways probe,
SERVING once the router has listed its services and NOT_SERVING while it drains."""
from __future__ import annotations

import asyncio
import logging

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from gpufleet_kit.body_budget import BodyBudget
from gpufleet_kit.tracing import Tracing

from ..fleet import Fleet
from ..tenants import Gate
from . import protocol, tls
from .choosing import Chooser
from .service import Processor

log = logging.getLogger("gpufleet_router.epp")

# Envoy's ext_proc messages carry at most a 62000-byte chunk; the largest message is well inside this.
MAX_MESSAGE_BYTES = 4 << 20
HEALTH_SERVICES = ("", protocol.SERVICE_NAME)


class EppServer:
    """The running picker: ``start``, then ``stop`` (graceful: streams in progress get ``grace`` seconds)."""

    def __init__(self, fleet: Fleet, body_budget: BodyBudget, host: str = "0.0.0.0", tracing: Tracing | None = None):
        self.fleet, self.host = fleet, host
        self.settings = fleet.settings
        self.chooser = Chooser(fleet, Gate(fleet))
        self.processor = Processor(fleet, self.chooser, body_budget, tracing)
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._ready: asyncio.Task | None = None

    async def start(self) -> int:
        """Listen on the settings' port (0: any free one); the port listened on."""
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.host}:{self.settings.epp_port or 0}"
        if self.settings.epp_secure:
            self.port = server.add_secure_port(address, tls.credentials(self.settings.epp_cert_path))
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        self.server = server
        self._ready = asyncio.create_task(self._serving_once_listed(), name="epp-health")
        log.info("endpoint picker listening on %s:%d (%s)", self.host, self.port,
                 "TLS" if self.settings.epp_secure else "plaintext")
        return self.port

    async def _serving_once_listed(self) -> None:
        await self.fleet.listed.wait()
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def draining(self) -> None:
        """Unready to the gateways' health checks, still answering streams."""
        for name in HEALTH_SERVICES:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float) -> None:
        if self._ready is not None:
            self._ready.cancel()
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.server.stop(grace)
            self.server = None
