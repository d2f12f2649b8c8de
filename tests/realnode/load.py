"""Streaming clients with the openai SDK, as the real-node tests send them: what they saw (answered,
refused with a 429 the client honours, failed), while a test acts on the pods behind them."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import openai

from tests.support.waiting import wait_for

MODEL = "tiny-llama"


@dataclass
class Load:
    ok: int = 0
    shed: int = 0  # 429 with Retry-After: the guard's admission, not an error
    errors: list[str] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)  # streams each client ended (answered, refused or failed)

    def describe(self) -> str:
        return f"ok {self.ok}, 429 {self.shed}, streams ended per client {self.ended}, errors {self.errors[-3:]}"


async def model_listed(client: openai.AsyncOpenAI, model: str = MODEL) -> bool:
    """Whether ``model`` is listed through ``client``: False while its address refuses or errs."""
    try:
        return model in [m.id async for m in client.models.list()]
    except openai.APIError:
        return False


def same_prompt(n: int) -> str:
    return "The real node says"


async def _stream_one(client: openai.AsyncOpenAI, load: Load, model: str, prompt: str, max_tokens: int) -> None:
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True)
        async for _ in stream:
            pass
        load.ok += 1
    except openai.RateLimitError:
        load.shed += 1
        await asyncio.sleep(0.5)
    except Exception as e:  # every other failure is what the test counts
        load.errors.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}"[:300])
        await asyncio.sleep(0.2)


async def in_flight_ended(load: Load, what: str, timeout: float = 300) -> None:
    """Every stream in flight now has ended since (each client ended one more): what became of each is in
    the counts, and in the router's resumption counters, which count a stream before its end goes out."""
    mark = list(load.ended)
    await wait_for(lambda: all(now > then for now, then in zip(load.ended, mark)), timeout=timeout,
                   what=f"the streams in flight at {what} to end",
                   describe=lambda: f"{load.describe()} (at {what}: {mark})")


async def answered_after(load: Load, what: str, clients: int = 2) -> None:
    """Streams that began after this moment were answered: past the ``clients`` in flight now, one
    more finished (or failed, which the test's error check then reports)."""
    mark = load.ok + load.shed + len(load.errors)
    await wait_for(lambda: load.ok + load.shed + len(load.errors) > mark + clients and load.ok > 0, timeout=120,
                   what=f"a stream begun after {what} answered")


@contextlib.asynccontextmanager
async def streaming(client: openai.AsyncOpenAI, clients: int = 2, model: str = MODEL,
                    prompt: Callable[[int], str] = same_prompt, max_tokens: int = 12, send=None, pause: float = 0.2):
    """``clients`` streaming clients in a loop while the body runs (more starve a second engine's
    start on a 2-core machine), the n-th request of all with ``prompt(n)``; what they saw. ``send``:
    how one stream is sent and judged (``_stream_one`` unless given)."""
    result, stop = Load(ended=[0] * clients), asyncio.Event()
    sent = 0
    one = send or _stream_one

    async def worker(index: int):
        nonlocal sent
        while not stop.is_set():
            sent += 1
            await one(client, result, model, prompt(sent), max_tokens)
            result.ended[index] += 1
            await asyncio.sleep(pause)
    tasks = [asyncio.create_task(worker(i)) for i in range(clients)]
    try:
        yield result
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def _checked_one(client: openai.AsyncOpenAI, load: Load, model: str, prompt: str, max_tokens: int) -> None:
    """One stream of exactly ``max_tokens`` tokens (``ignore_eos``), checked whole: one id, text, a
    finish_reason of "length" and a usage counting every token. A stream cut short or malformed is an
    error as much as one that raised."""
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        ids, text, finish, usage = set(), "", None, None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        if len(ids) != 1 or not text or finish != "length" or usage is None \
                or usage.completion_tokens != max_tokens or usage.prompt_tokens <= 0:
            load.errors.append(f"{time.strftime('%H:%M:%S')} malformed stream: ids {len(ids)}, finish {finish}, "
                               f"usage {usage}, {len(text)} characters")
            return
        load.ok += 1
    except openai.RateLimitError:
        load.shed += 1
        await asyncio.sleep(0.5)
    except Exception as e:
        load.errors.append(f"{time.strftime('%H:%M:%S')} {type(e).__name__}: {e}"[:300])
        await asyncio.sleep(0.2)


def checked_streaming(client: openai.AsyncOpenAI, clients: int = 2, model: str = MODEL,
                      prompt: Callable[[int], str] = same_prompt, max_tokens: int = 48):
    """As ``streaming``, with every stream checked whole (``_checked_one``): long enough answers that a
    change lands in the middle of some."""
    return streaming(client, clients, model, prompt, max_tokens, send=_checked_one, pause=0.1)
