"""The adapter agent: the LoRA adapters of this replica, as the operator's ``PUT /adapters`` wants them.

``PUT /adapters`` (an ``AdapterSet``, contract/adapters.py) is checked and stored, and answered
202 at once; a reconcile loop then fetches what is missing (adapter_fetch.py), checks it
(adapter_check.py), loads it through vLLM's runtime LoRA API (``POST /v1/load_lora_adapter``),
and unloads what left the set (``POST /v1/unload_lora_adapter``) once no request of this replica
uses it. Each pass first reads vLLM's ``/v1/models``: an adapter vLLM no longer lists (it
restarted) is loaded again, one it lists that the set does not want is unloaded. ``GET
/adapters`` answers an ``AdapterReport``. The decisions are the book's (adapter_book.py, pure);
this module does the I/O. A failed adapter is reported and counted, and never touches the base
model or the other adapters; only SourceUnreachable is retried by itself, with backoff.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from gpufleet_api import bounded_json, redact, typed
from gpufleet_api.guard.adapters import ADAPTER_DIR, ADAPTER_DIR_ENV, AdapterReport, AdapterSet, AdapterSpec
from gpufleet_api.guard.guard_config import AdapterFetchConfig, LoraConfig
from gpufleet_engine.serving import adapter_check, adapter_fetch
from gpufleet_engine.serving.adapter_book import AdapterBook, Step
from gpufleet_engine.serving.adapter_check import AdapterProblem
from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_engine.serving.upstream import Upstream

log = logging.getLogger("gpufleet_engine.serving.adapters")

POLL_SECONDS = 2.0
VLLM_CALL_SECONDS = 120.0   # a load reads the adapter from disk inside vLLM's engine
# A name that is one folder under the adapter directory and a model name clients can send.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")

Fetch = Callable[..., Path]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class AdapterAgent:
    def __init__(self, lora: LoraConfig, *, served_model_name: str, base_model: str, upstream: Upstream,
                 metrics: GuardMetrics, in_use: Counter[str], engine_up: Callable[[], bool],
                 adapter_dir: Path | None = None, clock: Callable[[], float] = time.time,
                 fetch: Fetch | None = None, poll_seconds: float = POLL_SECONDS,
                 fetch_limits: AdapterFetchConfig = adapter_fetch.DEFAULT_LIMITS):
        self.lora = lora
        self.served_model_name = served_model_name
        self.base_model = base_model
        self.upstream = upstream
        self.metrics = metrics
        self.in_use = in_use
        self.engine_up = engine_up
        self.adapter_dir = adapter_dir or Path(os.environ.get(ADAPTER_DIR_ENV, ADAPTER_DIR))
        self.clock = clock
        # The bounds of a fetch (guard.json's adapters, a live field: ``server`` sets a new one here).
        self.fetch_limits = fetch_limits
        self.fetch = fetch or self._fetch
        self.poll_seconds = poll_seconds
        self.book = AdapterBook()
        self._wake = asyncio.Event()
        metrics.adapter_states = lambda: [(name, e.state) for name, e in sorted(self.book.entries.items())]

    def _fetch(self, spec: AdapterSpec, adapter_dir: Path) -> Path:
        return adapter_fetch.fetch(spec, adapter_dir, limits=self.fetch_limits)

    # --- the endpoint ----------------------------------------------------------

    def desire(self, raw: object) -> tuple[int, dict]:
        """A ``PUT /adapters`` body: (status, answer). 202 once stored; 422 naming the field."""
        try:
            adapters = typed.convert(AdapterSet, raw)
        except typed.Invalid as e:
            return 422, _problem(str(e), e.problems[0].path if e.problems else None)
        problems = self._problems(adapters)
        if problems:
            return 422, _problem("; ".join(p for _, p in problems), problems[0][0])
        self.book.desire(adapters, self.clock())
        for spec in adapters.adapters:
            self.metrics.add_adapter(spec.name)
        self.poke()
        return 202, typed.to_builtins(self.report())

    def _problems(self, adapters: AdapterSet) -> list[tuple[str, str]]:
        out = []
        if len(adapters.adapters) > self.lora.max_adapters:
            out.append(("adapters", f"{len(adapters.adapters)} adapters, but this replica holds at most "
                                    f"{self.lora.max_adapters} (spec.engine.lora.maxAdapters)"))
        seen: set[str] = set()
        for i, spec in enumerate(adapters.adapters):
            where = f"adapters[{i}]"
            if not _NAME.match(spec.name):
                out.append((f"{where}.name", f"{spec.name!r} is not a name of letters, digits, '.', '-' and '_'"))
            elif spec.name == self.served_model_name:
                out.append((f"{where}.name", f"{spec.name!r} is the base model's name"))
            elif spec.name in seen:
                out.append((f"{where}.name", f"{spec.name!r} appears twice"))
            seen.add(spec.name)
            source = spec.source
            given = [k for k, v in (("huggingFace", source.hugging_face), ("path", source.path), ("uri", source.uri))
                     if v is not None]
            if len(given) != 1:
                out.append((f"{where}.source", f"exactly one of huggingFace, path or uri, got "
                                               f"{', '.join(given) or 'none'}"))
        return out

    def report(self) -> AdapterReport:
        lora = self.lora
        return self.book.report(lora.max_adapters, lora.max_loras, lora.max_cpu_loras or lora.max_loras)

    def serves(self, name: str) -> bool:
        return self.book.serves(name)

    def poke(self) -> None:
        """Reconcile now (a new set; vLLM came back)."""
        self._wake.set()

    # --- the loop ----------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception:  # the loop must outlive any one adapter's surprise
                log.exception("adapter reconcile pass failed; next pass in %gs", self.poll_seconds)
            self._wake.clear()
            wait = self.poll_seconds
            due = self.book.next_retry()
            if due is not None:
                wait = max(0.05, min(wait, due - self.clock()))
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass

    async def reconcile(self) -> None:
        """One pass: read what vLLM holds, then do each step the book asks for."""
        if self.engine_up() and self.book.entries:
            held = await self._engine_adapters()
            if held is not None:
                for name in self.book.engine_holds(held, self.clock()):
                    log.warning("vLLM lost adapter %s (it restarted); loading it again", name)
        for step in self.book.next_steps(self.clock(), lambda name: self.in_use.get(name, 0), self.engine_up()):
            await self._do(step)

    async def _do(self, step: Step) -> None:
        now = self.clock
        if step.kind == "fetch":
            try:
                path = await asyncio.to_thread(self.fetch, step.spec, self.adapter_dir)
                checked = await asyncio.to_thread(adapter_check.check, path, max_rank=self.lora.max_lora_rank,
                                                  served_model=self.base_model, base_model=step.spec.base_model)
            except AdapterProblem as p:
                self._failed(step, p)
            except Exception as e:  # a surprise fails this adapter, never the loop or the others
                log.error("fetching adapter %s failed: %s", step.name, redact.text(repr(e)))
                self._failed(step, AdapterProblem("LoadFailed", f"the guard could not fetch it: "
                                                                f"{type(e).__name__}: {redact.text(str(e))}"))
            else:
                self.book.fetched(step.name, step.spec, checked.path, checked.rank, now())
        elif step.kind == "load":
            assert step.path is not None
            problem = await self._call("/v1/load_lora_adapter", {"lora_name": step.name, "lora_path": str(step.path)})
            if problem is None:
                self.book.loaded(step.name, step.spec, now())
                log.info("adapter %s loaded from %s", step.name, step.path)
            elif problem is not _ENGINE_GONE:
                self._failed(step, AdapterProblem("LoadFailed", f"vLLM refused to load it: {problem}"))
        elif step.kind == "unload":
            problem = await self._call("/v1/unload_lora_adapter", {"lora_name": step.name})
            if problem is None or problem.startswith("404"):
                self.book.unloaded(step.name)
                log.info("adapter %s unloaded", step.name)
            elif problem is not _ENGINE_GONE:
                log.warning("vLLM refused to unload adapter %s: %s; retrying", step.name, problem)
        elif step.kind == "forget":
            await asyncio.to_thread(adapter_fetch.remove, step.spec, self.adapter_dir)
            self.book.forgotten(step.name)
            self.metrics.remove_adapter(step.name)

    def _failed(self, step: Step, problem: AdapterProblem) -> None:
        message = redact.text(problem.message)  # a source's credentials and signatures are never shown
        if self.book.failed(step.name, step.spec, problem.reason, message, self.clock()):
            log.warning("adapter %s failed: %s: %s", step.name, problem.reason, message)
            self.metrics.adapter_load_failures.labels(step.name, problem.reason).inc()

    async def _engine_adapters(self) -> set[str] | None:
        """The adapters vLLM lists (``/v1/models`` entries with a parent); None if it did not answer."""
        assert self.upstream.session is not None
        try:
            async with self.upstream.session.get(self.upstream.url("/v1/models"),
                                                 timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status != 200:
                    return None
                doc = bounded_json.loads(await resp.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        entries = doc.get("data") if isinstance(doc, dict) else None
        return {e["id"] for e in entries or ()
                if isinstance(e, dict) and e.get("parent") and isinstance(e.get("id"), str)}

    async def _call(self, path: str, body: dict) -> str | None:
        """POST to vLLM's runtime LoRA API: None when done, else "<status> <message>", or
        _ENGINE_GONE when vLLM did not answer (the step is tried again on a later pass)."""
        assert self.upstream.session is not None
        try:
            async with self.upstream.session.post(self.upstream.url(path), json=body,
                                                  timeout=aiohttp.ClientTimeout(total=VLLM_CALL_SECONDS)) as resp:
                if resp.status == 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return _ENGINE_GONE
        try:
            message = bounded_json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            message = text
        return f"{resp.status} {message}"


_ENGINE_GONE = "engine gone"


def _problem(message: str, param: str | None) -> dict:
    return {"error": {"message": message, "type": "UnprocessableEntityError", "param": param, "code": 422}}


def register(app: web.Application, agent: AdapterAgent | None,
             protect: Callable[[Handler], Handler] = lambda handler: handler) -> None:
    """``GET`` and ``PUT /adapters``, each behind ``protect`` (the operator's token: server.py); with
    LoRA off, PUT answers 409 and GET an empty report."""
    from gpufleet_api.guard.adapters import ADAPTERS_PATH

    async def put(request: web.Request) -> web.Response:
        if agent is None:
            return web.json_response({"error": {
                "message": "LoRA adapters are off on this replica: set spec.engine.lora on the "
                           "InferenceService (engine.lora in guard.json) to serve adapters.",
                "type": "ConflictError", "param": "engine.lora", "code": 409}}, status=409)
        try:
            raw = bounded_json.loads(await request.read())
        except bounded_json.TooDeep as e:
            return web.json_response({"error": {"message": f"the body is {e}", "type": "BadRequestError",
                                                "param": None, "code": 400}}, status=400)
        except ValueError as e:
            return web.json_response(_problem(f"the body is not valid JSON: {e}", None), status=422)
        status, answer = agent.desire(raw)
        return web.json_response(answer, status=status)

    async def get(request: web.Request) -> web.Response:
        report = agent.report() if agent is not None else AdapterReport()
        return web.json_response(typed.to_builtins(report))

    app.router.add_put(ADAPTERS_PATH, protect(put))
    app.router.add_get(ADAPTERS_PATH, protect(get))
