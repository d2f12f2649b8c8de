"""Reading what each replica's prefix cache holds from its guard (the feed of gpufleet_api.guard.kv_blocks),
and the service's tokenizer to look requests up in it with. Fleet.read_once calls these beside each reading.

A guard without the feed (vLLM's events off, a guard older than the feed) answers 404: the replica is placed
by what the router learned (policy/choice.py). A feed read that fails drops the view until the next one
succeeds (its whole set, since the view is gone).
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec

from gpufleet_api.guard import kv_blocks
from gpufleet_kit.http_limits import ReplyTooLarge, read_capped

from .policy.choice import Picker
from .prompt_tokens import PromptTokens

log = logging.getLogger("gpufleet_router")

FEED_REPLY_CAP = 64 << 20         # the whole set of a replica's 4M cached blocks (8 bytes each, base64)
TOKENIZER_REPLY_CAP = 64 << 20    # a tokenizer.json with a large vocabulary and merges list


async def read_feed(http: aiohttp.ClientSession, picker: Picker, pod: str, address: str,
                    timeout: aiohttp.ClientTimeout, taken_at: float) -> bool:
    """Apply the guard's answer to the replica's view. True where the guard follows vLLM's events, fed or not
    yet (503 before vLLM's first batch: no view, but the service's tokenizer is worth loading)."""
    view = picker.cache_view(pod)
    if view is None:
        return False
    params = {"epoch": view.epoch, "since": str(view.seq)} if view.epoch is not None else {}
    try:
        async with http.get(f"http://{address}{kv_blocks.KV_BLOCKS_PATH}", params=params, timeout=timeout) as r:
            if r.status != 200:
                picker.no_cache_feed(pod)
                return r.status == 503
            feed = msgspec.json.decode(await read_capped(r, FEED_REPLY_CAP, f"{pod} ({address})"),
                                       type=kv_blocks.BlocksFeed)
        view.apply(feed, taken_at)
        return True
    except (ReplyTooLarge, msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        log.warning("cannot read the prefix cache of %s (%s): %s", pod, address, e)
    except Exception as e:  # unreachable now: its next read starts from the whole set
        log.debug("cannot read the prefix cache of %s (%s): %s", pod, address, e)
    picker.no_cache_feed(pod)
    return False


async def read_tokenizer(http: aiohttp.ClientSession, address: str,
                         timeout: aiohttp.ClientTimeout) -> PromptTokens | None:
    """The service's tokenizer from one of its guards; None while it has none to give."""
    try:
        async with http.get(f"http://{address}{kv_blocks.KV_TOKENIZER_PATH}", timeout=timeout) as r:
            if r.status != 200:
                return None
            body = await read_capped(r, TOKENIZER_REPLY_CAP, address)
        files = msgspec.json.decode(body, type=kv_blocks.TokenizerFiles)
        return await asyncio.to_thread(PromptTokens, files)   # a large vocabulary takes a while to load
    except Exception as e:  # any failure: the next read asks again
        log.info("cannot load the tokenizer from %s: %s", address, e)
        return None
