"""The context length vLLM really serves, read from its ``/v1/models``.

Without ``engine.maxModelLen`` vLLM runs with the model's own context (131072
tokens for Llama-3.1-8B, 4096 for the tiny test model), which only vLLM knows
for sure once it has loaded the model's config. vLLM lists it per served model
as ``max_model_len`` in ``/v1/models``; the guard reads it there once vLLM
answers and stays not ready until it has, so it never admits against a
guessed limit. With ``engine.maxModelLen`` set the guard knows the number
from its own file and reads nothing.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp

from gpufleet_engine.errors import GuardError

log = logging.getLogger("gpufleet_engine.serving.served_context")

RETRY_SECONDS = 1.0


class NoContextLength(GuardError, ValueError):
    """``/v1/models`` answered but says nothing usable about the served model's context."""


class NoMaxModelLen(NoContextLength):
    """The served model is listed without ``max_model_len`` (an engine other than vLLM's server)."""


def served_max_model_len(document: Any, served_model_name: str) -> int:
    """``max_model_len`` of ``served_model_name`` in a ``/v1/models`` answer."""
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        raise NoContextLength("vLLM's /v1/models answer has no data list")
    entries = [m for m in data if isinstance(m, dict)]
    entry = next((m for m in entries if m.get("id") == served_model_name), None)
    if entry is None:
        served = ", ".join(str(m.get("id")) for m in entries) or "none"
        raise NoContextLength(f"vLLM serves {served}, not {served_model_name!r} (servedModelName)")
    value = entry.get("max_model_len")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NoMaxModelLen(f"vLLM's /v1/models reports no max_model_len for {served_model_name!r}; "
                              f"set spec.model.maxModelLen (engine.maxModelLen in guard.json)")
    return value


async def read(session: aiohttp.ClientSession, models_url: str, served_model_name: str,
               timeout: float = 5.0) -> int:
    """GET ``/v1/models`` and return the served context; raise NoContextLength, aiohttp.ClientError or
    TimeoutError."""
    async with session.get(models_url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise NoContextLength(f"vLLM's /v1/models answered {resp.status}")
        return served_max_model_len(await resp.json(content_type=None), served_model_name)


async def learn(session: aiohttp.ClientSession, models_url: str, served_model_name: str,
                engine_up: Callable[[], bool], on_learned: Callable[[int], None],
                on_problem: Callable[[str], None], fallback: Callable[[], int | None] = lambda: None,
                retry_seconds: float = RETRY_SECONDS) -> int:
    """Read the served context once vLLM is up, retrying until it answers; report it and return it.

    ``fallback``: the configured maxContextTokens, taken as the context when the engine lists the
    model without a max_model_len (it cannot be learned, and the operator set a limit)."""
    last = None
    while True:
        if engine_up():
            try:
                length = await read(session, models_url, served_model_name)
            except NoMaxModelLen as e:
                configured = fallback()
                if configured is None:
                    on_problem(str(e))
                else:
                    log.warning("%s; taking maxContextTokens %d as the context", e, configured)
                    on_learned(configured)
                    return configured
            except (NoContextLength, aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                problem = str(e) or repr(e)
                if problem != last:
                    log.warning("cannot read the served context length: %s; retrying", problem)
                last = problem
                on_problem(problem)
            else:
                log.info("vLLM serves %r with a context of %d tokens", served_model_name, length)
                on_learned(length)
                return length
        await asyncio.sleep(retry_seconds)
