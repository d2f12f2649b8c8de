"""The guard's HTTP server: routes, engine monitor, start, drain and stop.

``GuardServer`` is what ``gpufleet engine serve`` runs and what tests start
in-process; ``serve`` adds the signal handling of a real process.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
from pathlib import Path

from aiohttp import web

from gpufleet_api.guard import demand_prior, kv_blocks
from gpufleet_api.guard.endpoints import ENGINE_METRICS_PATH, GUARD_METRICS_PATH
from gpufleet_api.guard.guard_config import GuardConfig
from gpufleet_api.tracing import GUARD_SERVICE_NAME, SERVICE
from gpufleet_engine.admission.core import max_body_bytes
from gpufleet_engine.admission.tokens import HfTokenizer, Tokenizer, generation_default_max_tokens
from gpufleet_engine.serving import (
    adapters,
    kv_storage,
    kv_subscriber,
    memory_report,
    reload,
    served_context,
    shared_demand,
    vllm_endpoints,
)
from gpufleet_engine.serving import vllm_metrics_relay as engine_metrics
from gpufleet_engine.serving.errors import error_response
from gpufleet_engine.serving.guard import Guard
from gpufleet_engine.serving.operator_only import operator_only
from gpufleet_engine.serving.operator_tokens import OperatorTokens
from gpufleet_engine.serving.upstream import EngineMonitor, Upstream
from gpufleet_engine.vllm import shared_storage
from gpufleet_kit.tracing import Tracing

log = logging.getLogger("gpufleet_engine.serving.server")

TOKENIZER_RETRY_SECONDS = 5.0
DRAIN_READ_LIMIT_BYTES = 1 << 20


def build_app(guard: Guard, adapter_agent: adapters.AdapterAgent | None = None,
              tokens: OperatorTokens | None = None,
              kv_events: kv_subscriber.KVEventsFollower | None = None) -> web.Application:
    """The guard's port. Its control routes take the operator's token (``tokens``, by default
    guard.json's ``controlAuth``); POST /drain is on the admin socket only (``build_admin_app``).
    ``kv_events``: what vLLM's prefix cache holds, for the router (kv_subscriber.py; None: not followed)."""
    tokens = tokens if tokens is not None else OperatorTokens(guard.config.control_auth)
    # Bodies are bounded before they are parsed (docs/guard-config.md).
    # The proxied routes and vLLM's other routes read their bodies themselves, bounded by the guard's current
    # limit and counted in its bodyBudgetBytes (guard.py).
    app = web.Application(client_max_size=max_body_bytes(0))

    async def close_while_draining(request: web.Request, response: web.StreamResponse) -> None:
        # Clients' keep-alive connections bypass the Service's endpoint removal: close them. A body
        # left unread (a refusal answers before reading) is read first: closing a socket with unread
        # input resets it, and the client loses the answer. Past the body limit, keep-alive decides.
        if not guard.drain.draining:
            return
        if not request.content.at_eof():
            if (request.content_length or 0) > DRAIN_READ_LIMIT_BYTES:
                return
            await request.read()
        response.force_close()
        # aiohttp has written its Connection header by now; say it to the client as well.
        response.headers["Connection"] = "close"
    app.on_response_prepare.append(close_while_draining)

    async def metrics(request: web.Request) -> web.Response:
        guard.refresh_gauges()
        # OpenMetrics (with the latency histograms' exemplars) when the scraper asks for it.
        body, content_type = guard.metrics.render_for(request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def vllm_metrics(request: web.Request) -> web.Response:
        # vLLM listens on the pod's loopback only: its metrics are scraped here.
        return await engine_metrics.read(guard.upstream, request)

    async def healthz(request: web.Request) -> web.Response:
        # Liveness: the event loop answers. Engine trouble is readiness's job;
        # restarting the guard would not fix vLLM.
        return web.json_response({"alive": True})

    async def readyz(request: web.Request) -> web.Response:
        reasons = guard.not_ready_reasons()
        return web.json_response({"ready": not reasons, "reasons": reasons}, status=200 if not reasons else 503)

    async def drain_status(request: web.Request) -> web.Response:
        return _drain_status(guard)

    async def drain_elsewhere(request: web.Request) -> web.Response:
        # Whatever its source address: a mesh sidecar or a port-forward makes every caller loopback.
        where = guard.config.admin_socket or "(none configured: guard.json adminSocket)"
        return error_response(403, "forbidden", "POST /drain is not taken on the guard's port: only the "
                              f"pod itself starts a drain, through the guard's admin socket {where} "
                              "(its preStop hook runs gpufleet-engine drain-wait), or with SIGTERM.")

    async def audit_report(request: web.Request) -> web.Response:
        # Device memory as vLLM's own processes reported it (vllm_plugin); the guard touches no GPU.
        device = guard.metrics.gpu_memory.read().as_report()
        kv = memory_report.kv_report(guard.stats, guard.admission.ledger, guard.block_size, guard.sequences(),
                             guard.sequences_at_read)
        return web.json_response(memory_report.assemble(guard.config.service, guard.config.namespace, device, kv))

    async def demand(request: web.Request) -> web.Response:
        # What this replica learned of its answers' lengths, for the operator to hand to new replicas.
        shared = shared_demand.export(guard.admission.predictor, guard.admission.ledger)
        return web.json_response(demand_prior.to_document(shared))

    app.router.add_get("/drain", drain_status)
    app.router.add_post("/drain", drain_elsewhere)
    app.router.add_get(GUARD_METRICS_PATH, metrics)
    app.router.add_get(ENGINE_METRICS_PATH, vllm_metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    # What a replica holds and learned, and what it serves: the operator's to read and to change.
    app.router.add_get("/audit", operator_only(tokens, audit_report))
    app.router.add_get(demand_prior.DEMAND_PATH, operator_only(tokens, demand))
    adapters.register(app, adapter_agent, lambda handler: operator_only(tokens, handler))
    if kv_events is not None:
        # What vLLM's prefix cache holds, and the tokenizer to look a request up in it with: the router's.
        app.router.add_get(kv_blocks.KV_BLOCKS_PATH, kv_subscriber.blocks_route(kv_events))
        app.router.add_get(kv_blocks.KV_TOKENIZER_PATH,
                           kv_subscriber.tokenizer_route(lambda: guard.admission.tokenizer))
    # vLLM's own API (vllm/routes.py): admitted, answered with the guard's state, or passed through.
    vllm_endpoints.register(app, guard, tokens)
    return app


def _drain_status(guard: Guard) -> web.Response:
    return web.json_response({"draining": guard.drain.draining, "refusing": guard.drain.refusing,
                              "active": guard.drain.active})


def build_admin_app(guard: Guard) -> web.Application:
    """The admin socket (guard.json ``adminSocket``, in an emptyDir only the pod's containers
    mount): what only the pod itself calls, so the socket is the proof. POST /drain from the
    preStop hooks, and vLLM's admin routes for someone who execs into the pod."""
    app = web.Application(client_max_size=DRAIN_READ_LIMIT_BYTES)

    async def drain_status(request: web.Request) -> web.Response:
        return _drain_status(guard)

    async def drain_start(request: web.Request) -> web.Response:
        guard.begin_drain()
        return _drain_status(guard)

    app.router.add_get("/drain", drain_status)
    app.router.add_post("/drain", drain_start)
    vllm_endpoints.register_admin(app, guard)
    return app


def _remove_stale_socket(path: Path) -> None:
    """A socket left by a guard that died is in the way; nothing else lives in that emptyDir."""
    if path.is_socket():
        path.unlink()


def _owner_only(path: Path) -> None:
    """The pod's user (both containers run as it), nobody else."""
    path.chmod(0o600)


def freeze_startup_heap() -> None:
    """Move everything loaded so far (transformers, the tokenizer) out of the
    collector's reach. A full collection otherwise walks that whole heap (about
    40 ms of CPU here, and far longer in wall time when vLLM holds the cores)
    in the middle of some request's stream."""
    gc.collect()
    gc.freeze()


class GuardServer:
    def __init__(self, config: GuardConfig, tokenizer: Tokenizer | None = None,
                 config_path: str | None = None, reload_seconds: float = reload.POLL_SECONDS,
                 tracing: Tracing | None = None):
        """``config_path``: the file ``config`` came from; its live changes are applied (reload.py).
        ``tracing``: the guard's spans (None: per ``config.tracing``; tests pass an in-memory one)."""
        self.config = config
        self._owns_tracing = tracing is None
        self.tracing = tracing or Tracing.start(config.tracing, GUARD_SERVICE_NAME, {
            "service.namespace": config.namespace, SERVICE: config.service, "gpufleet.role": config.role})
        self._config_path = config_path
        self._reload_seconds = reload_seconds
        self.watcher: reload.ConfigWatcher | None = None
        self._tokenizer = tokenizer
        self.guard: Guard | None = None
        self._runner: web.AppRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self.tokens = OperatorTokens(config.control_auth)
        self._monitor_task: asyncio.Task | None = None
        self._tokenizer_task: asyncio.Task | None = None
        self._side_tasks: list[asyncio.Task] = []
        self.adapters: adapters.AdapterAgent | None = None
        self.kv_events: kv_subscriber.KVEventsFollower | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.config.listen_host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        upstream = Upstream(self.config.engine_url, max_connections=self.config.max_concurrency + 8)
        await upstream.start()
        guard = Guard(self.config, self._tokenizer, upstream, tracing=self.tracing)
        if self._config_path:
            # Start from the output lengths the service's other replicas learned, not from the full
            # budget: a replica added under load needs them most (contract/demand_prior.py).
            seen = self._seed_demand(guard, None)
            self._side_tasks.append(asyncio.create_task(self._follow_demand(guard, seen), name="demand-prior"))
        monitor = EngineMonitor(upstream, self.config.metrics_poll_seconds, guard.engine_stats, guard.engine_down)
        guard.on_engine_unreachable = monitor.poke
        self.guard = guard
        self._monitor_task = asyncio.create_task(monitor.run(), name="engine-monitor")
        if guard.admission.tokenizer is None:
            self._tokenizer_task = asyncio.create_task(self._load_tokenizer(guard), name="tokenizer")
        if guard.admission.served_context is None:
            self._side_tasks.append(asyncio.create_task(self._learn_context(guard), name="served-context"))
        engine = self.config.engine
        if engine is not None and engine.lora is not None:
            agent = adapters.AdapterAgent(engine.lora, served_model_name=self.config.served_model_name,
                                          base_model=engine.model, upstream=upstream, metrics=guard.metrics,
                                          in_use=guard.services.adapters_in_use, engine_up=lambda: guard.engine_up,
                                          fetch_limits=self.config.adapters)
            guard.admission.adapter_served = agent.serves
            guard.on_engine_up = agent.poke
            self.adapters = agent
            self._side_tasks.append(asyncio.create_task(agent.run(), name="adapters"))
        if engine is not None and engine.kv_events is not None:
            self.kv_events = kv_subscriber.KVEventsFollower(engine.kv_events)
            self._side_tasks.append(asyncio.create_task(self.kv_events.run(), name="kv-events"))
        storage = shared_storage.bounded_directory(self.config.engine)
        if storage is not None:
            # The shared-storage connector never removes its files; the pods that write them do.
            self._side_tasks.append(asyncio.create_task(kv_storage.keep_bounded(*storage, guard.metrics),
                                                        name="kv-storage"))
        if self._config_path:
            def apply(config: GuardConfig) -> None:
                guard.configure(config)  # the same configure that set it up at start-up
                self.tokens.configure(config.control_auth)  # a rotated signing key, another operator
                if self.adapters is not None:
                    self.adapters.fetch_limits = config.adapters
                monitor.interval = config.metrics_poll_seconds
            self.watcher = reload.ConfigWatcher(self._config_path, self.config, apply, guard.metrics,
                                                self._reload_seconds)
            self._side_tasks.append(asyncio.create_task(self.watcher.run(), name="config-reload"))
        # handler_cancellation: a client that disconnects cancels its handler,
        # which closes the upstream connection and makes vLLM abort the work.
        self._runner = web.AppRunner(build_app(guard, self.adapters, self.tokens, self.kv_events),
                                     handler_cancellation=True,
                                     access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.listen_host, self.config.listen_port)
        try:
            await site.start()
            if self.config.admin_socket:
                await self._start_admin(guard, Path(self.config.admin_socket))
        except OSError:
            await self.stop()
            raise
        # listenPort 0 lets the OS pick (tests); report the port really bound.
        self.port = self._runner.addresses[0][1] if self._runner.addresses else self.config.listen_port
        log.info("guard listening on %s for vLLM at %s", self.url, self.config.engine_url)

    async def _start_admin(self, guard: Guard, path: Path) -> None:
        _remove_stale_socket(path)
        self._admin_runner = web.AppRunner(build_admin_app(guard), access_log=None, shutdown_timeout=1.0)
        await self._admin_runner.setup()
        await web.UnixSite(self._admin_runner, str(path)).start()
        _owner_only(path)
        log.info("admin socket at %s", path)

    def _seed_demand(self, guard: Guard, seen: float | None) -> float | None:
        """Seed the keys this guard has not learned from demand.json beside guard.json, when the
        file changed since ``seen`` (its mtime); returns the mtime read."""
        assert self._config_path is not None
        path = shared_demand.prior_path(self._config_path)
        try:
            stamp: float | None = path.stat().st_mtime
        except OSError:
            return None
        if stamp == seen:
            return seen
        prior = shared_demand.read(path)
        classes = {c.name for c in guard.config.queue_classes}
        seeded = shared_demand.seed(guard.admission.predictor, guard.admission.ledger, prior, classes) if prior else []
        if seeded:
            log.info("started from what the service learned (%s): %s", path, ", ".join(seeded))
        return stamp

    async def _follow_demand(self, guard: Guard, seen: float | None) -> None:
        """A later demand.json (the kubelet updates the mounted ConfigMap) seeds what is still unlearned."""
        while True:
            await asyncio.sleep(self._reload_seconds)
            seen = self._seed_demand(guard, seen)

    async def _learn_context(self, guard: Guard) -> None:
        assert guard.upstream.session is not None

        await served_context.learn(guard.upstream.session, guard.upstream.url("/v1/models"),
                                   self.config.served_model_name, lambda: guard.engine_up,
                                   guard.served_context_learned, guard.served_context_problem,
                                   fallback=lambda: guard.config.max_context_tokens)

    async def _load_tokenizer(self, guard: Guard) -> None:
        # Retried: in a pod the tokenizer files may appear only once vLLM's
        # container has downloaded the model into a shared cache. Until then
        # the guard is alive but not ready.
        while True:
            try:
                tokenizer = await asyncio.to_thread(HfTokenizer.load, self.config.tokenizer,
                                                    self.config.tokenizer_revision)
            except Exception as e:  # any loader failure means "not yet"; the message says why
                problem = f"{self.config.tokenizer!r}: {e}"
                if problem != guard.tokenizer_problem:
                    log.warning("cannot load the tokenizer %s; retrying every %gs",
                                problem, TOKENIZER_RETRY_SECONDS)
                guard.tokenizer_failed(problem)
                await asyncio.sleep(TOKENIZER_RETRY_SECONDS)
            else:
                guard.tokenizer_loaded(tokenizer, generation_default_max_tokens(self.config.tokenizer))
                log.info("tokenizer loaded from %s", self.config.tokenizer)
                freeze_startup_heap()
                return

    async def wait_ready(self, timeout: float) -> None:
        """Until the engine has been read once (tests and the local backend use this)."""
        assert self.guard is not None
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.guard.ready:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"guard not ready after {timeout:g}s: "
                                   f"{'; '.join(self.guard.not_ready_reasons())}")
            await asyncio.sleep(0.05)

    async def drain(self, timeout: float | None = None) -> bool:
        """Refuse new requests and wait for accepted ones; True if all finished in time."""
        assert self.guard is not None
        self.guard.begin_drain()
        # The guard's config, not the one it started with: drainTimeoutSeconds is a live setting.
        timeout = self.guard.config.drain_timeout_seconds if timeout is None else timeout
        log.info("draining: %d requests to finish, up to %gs", self.guard.drain.active, timeout)
        finished = await self.guard.drain.wait_idle(timeout)
        if not finished:
            log.warning("drain timeout: %d requests still running are cut off", self.guard.drain.active)
        return finished

    async def stop(self) -> None:
        for task in (self._monitor_task, self._tokenizer_task, *self._side_tasks):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for runner in (self._runner, self._admin_runner):
            if runner is not None:
                await runner.cleanup()
        if self.guard is not None:
            await self.guard.upstream.close()
        if self._owns_tracing:
            await asyncio.to_thread(self.tracing.shutdown)  # the spans still batched go out


async def serve(config: GuardConfig, config_path: str | None = None) -> int:
    """Run until SIGTERM/SIGINT, then drain and exit. Returns the process exit code."""
    server = GuardServer(config, config_path=config_path)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    finished = await server.drain()
    await server.stop()
    return 0 if finished else 1
