"""gpufleet's router in process over a fixed table (no API server): what the engine tests put in front of
their engines, as ``gpufleet router`` serves a cluster's."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from aiohttp.test_utils import TestServer

from gpufleet_kit.tracing import Tracing
from gpufleet_router.metrics import RouterMetrics
from gpufleet_router.policy.adapters import EMPTY, Catalog
from gpufleet_router.policy.table import Route, Table
from gpufleet_router.server import Fleet, Router, RouterSettings, client_session


@contextlib.asynccontextmanager
async def static_router(*routes: Route, settings: RouterSettings | None = None,
                        adapters: Catalog = EMPTY, tracing: Tracing | None = None) -> AsyncIterator[tuple[str, Fleet]]:
    """(the router's base URL, its Fleet) once it has read every replica's guard once; ``adapters``: the
    LoRA adapters it serves (adapters.Adapter by name; each routed to replicas whose guard holds it Loaded);
    ``tracing``: the router's spans (None: none)."""
    settings = settings or RouterSettings()
    fleet = Fleet(settings, RouterMetrics())
    http = client_session(settings)
    fleet.update(Table({r.model: r for r in routes}), adapters)
    await fleet.read_once(http)
    reads = asyncio.create_task(fleet.read(http))
    server = TestServer(Router(fleet, http, tracing).app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}", fleet
    finally:
        reads.cancel()
        await server.close()
        await http.close()
