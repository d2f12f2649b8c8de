"""guard.json changes reach a running guard (reload.py): the same process, new settings."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest

from gpufleet_api.guard import guard_config
from gpufleet_engine.serving import reload
from gpufleet_engine.serving.server import GuardServer
from tests.support.waiting import wait_for
from tests.unit.engine.test_guard_proxy import metrics, sample

ENGINE = {"model": "/models/m", "servedModelName": "m", "maxModelLen": 1000, "blockSize": 32, "maxNumSeqs": 8}


@pytest.fixture
async def reloading(fake_vllm, tokenizer, tmp_path):
    """A guard started from a file it watches every 20 ms; ``write(**changes)`` writes a new version."""
    path = tmp_path / "guard.json"
    base = {"servedModelName": "m", "tokenizer": "unused", "engineUrl": fake_vllm.url, "listenHost": "127.0.0.1",
            "listenPort": 0, "metricsPollSeconds": 0.05, "kvWatermarkPercent": 15, "engine": ENGINE}
    started: list[GuardServer] = []

    def write(**changes) -> None:
        path.write_text(json.dumps({**base, **changes}))

    async def start(**initial) -> GuardServer:
        base.update(initial)
        write()
        server = GuardServer(guard_config.load(path), tokenizer=tokenizer, config_path=str(path),
                             reload_seconds=0.02)
        await server.start()
        started.append(server)
        await server.wait_ready(5)
        return server

    yield start, write
    for s in started:
        await s.stop()


async def reloads(session, guard, result: str) -> float:
    return sample(await metrics(session, guard), "gpufleet_guard_config_reloads_total", result=result)


async def until_reloaded(session, guard, result: str, count: float = 1) -> None:
    async def done():
        return await reloads(session, guard, result) >= count
    deadline = asyncio.get_running_loop().time() + 5
    while not await done():
        assert asyncio.get_running_loop().time() < deadline, f"no {result} reload within 5s"
        await asyncio.sleep(0.02)


async def test_a_lower_watermark_admits_what_the_old_one_refused_in_the_same_process(reloading, fake_vllm):
    start, write = reloading
    fake_vllm.usage = 0.75                      # 48 of 64 blocks used; 15% keeps 10 free → 6 left
    guard = await start()
    inner = guard.guard
    request = {"prompt": "x " * 100, "max_tokens": 100}  # 7 blocks
    async with aiohttp.ClientSession() as s:
        async with s.post(guard.url + "/v1/completions", json=request) as r:
            assert r.status == 429
        write(kvWatermarkPercent=0)
        await until_reloaded(s, guard, "applied")
        async with s.post(guard.url + "/v1/completions", json=request) as r:
            assert r.status == 200
        text = await metrics(s, guard)
    assert guard.guard is inner and inner.config.kv_watermark_percent == 0
    assert sample(text, "gpufleet_guard_kv_watermark_blocks") == 0
    assert sample(text, "gpufleet_guard_config_restart_pending") == 0


@pytest.mark.parametrize("content, problem", [
    ('{"kvWatermarkPercent": 150', "not valid JSON"),
    (None, "kvWatermarkPercent: 150 is out of range"),
    ({"maxContextTokens": 4000}, "maxContextTokens: 4000 exceeds engine.maxModelLen 1000"),
])
async def test_an_invalid_new_version_is_refused_and_the_running_settings_stay(reloading, fake_vllm, caplog,
                                                                               content, problem):
    start, write = reloading
    guard = await start()
    path = guard.watcher.path
    if content is None:
        write(kvWatermarkPercent=150)
    elif isinstance(content, dict):
        write(**content)
    else:
        path.write_text(content)
    async with aiohttp.ClientSession() as s:
        await until_reloaded(s, guard, "invalid")
        assert await reloads(s, guard, "applied") == 0
        async with s.get(guard.url + "/readyz") as r:
            assert r.status == 200
    assert guard.guard.config.kv_watermark_percent == 15 and guard.guard.admission.limits.max_context_tokens == 1000
    assert problem in caplog.text and "keeping the running settings" in caplog.text


async def test_engine_changes_are_left_for_a_new_pod_and_live_ones_applied(reloading):
    start, write = reloading
    guard = await start()
    write(kvWatermarkPercent=20, engine={**ENGINE, "maxNumSeqs": 64})
    async with aiohttp.ClientSession() as s:
        await until_reloaded(s, guard, "applied")
        text = await metrics(s, guard)
    assert guard.guard.config.kv_watermark_percent == 20
    assert guard.guard.config.engine.max_num_seqs == 8  # vLLM still runs with the old engine section
    assert sample(text, "gpufleet_guard_config_restart_pending") == 1


async def test_more_concurrency_dispatches_the_requests_waiting_for_a_slot(reloading, fake_vllm):
    start, write = reloading
    fake_vllm.hold = asyncio.Event()
    guard = await start(maxConcurrency=1)
    async with aiohttp.ClientSession() as s:
        posts = [asyncio.create_task(s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                            headers={"x-gpufleet-class": "background"})) for _ in range(2)]
        await wait_for(lambda: fake_vllm.running == 1 and len(guard.guard.admission.queue) == 1, timeout=5,
                       interval=0.005, what="one request at vLLM, one queued")
        write(maxConcurrency=2)
        await wait_for(lambda: fake_vllm.running == 2, timeout=5, interval=0.005,
                       what="the queued request dispatched after the reload")
        fake_vllm.hold.set()
        for response in await asyncio.gather(*posts):
            assert response.status == 200
            response.release()
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_max_concurrency") == 2


async def test_new_queue_classes_take_requests_and_get_their_series(reloading):
    start, write = reloading
    guard = await start()
    write(queueClasses=[{"name": "bulk", "level": 1, "maxQueueSeconds": 5}],
          defaultClassByRoute={"/v1/completions": "bulk", "/v1/chat/completions": "bulk",
                               "/v1/embeddings": "bulk"})
    async with aiohttp.ClientSession() as s:
        await until_reloaded(s, guard, "applied")
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                          headers={"x-gpufleet-class": "interactive"}) as r:
            assert r.status == 400 and "use one of: bulk" in (await r.json())["error"]["message"]
        text = await metrics(s, guard)
    assert sample(text, "gpufleet_guard_requests_total", **{"class": "bulk", "outcome": "ok"}) == 1
    assert sample(text, "gpufleet_guard_queue_depth", **{"class": "bulk"}) == 0


async def test_a_lower_context_limit_applies_to_the_next_request(reloading):
    start, write = reloading
    guard = await start()
    async with aiohttp.ClientSession() as s:
        write(maxContextTokens=50, overLengthPolicy="Reject")
        await until_reloaded(s, guard, "applied")
        async with s.post(guard.url + "/v1/completions", json={"prompt": "x " * 60, "max_tokens": 5}) as r:
            assert r.status == 400 and "maximum context is 50 tokens" in (await r.json())["error"]["message"]


def test_live_and_restart_fields_split_the_whole_document():
    """Every field is one or the other; the pod template hashes exactly the restart ones."""
    config = guard_config.parse({"servedModelName": "m", "tokenizer": "t", "engine": ENGINE})
    document = guard_config.to_document(config)
    restart = guard_config.restart_document(config)
    assert "engine" in restart and "tokenizer" in restart and "listenPort" in restart
    assert not {"kvWatermarkPercent", "queueClasses", "maxConcurrency", "maxContextTokens"} & set(restart)
    live = {guard_config.key_of(f) for f in msgspec.structs.fields(guard_config.GuardConfig)
            if f.name in guard_config.LIVE_FIELDS}
    assert set(restart) | live == set(document) and not set(restart) & live


def test_a_file_that_does_not_change_is_not_reapplied(tmp_path):
    path = tmp_path / "guard.json"
    path.write_text(json.dumps({"servedModelName": "m", "tokenizer": "t"}))
    applied = []

    class Metrics:
        def __init__(self):
            from gpufleet_engine.serving.prometheus import GuardMetrics
            self.inner = GuardMetrics(["standard"])
            self.config_reloads = self.inner.config_reloads
            self.config_restart_pending = self.inner.config_restart_pending

    watcher = reload.ConfigWatcher(path, guard_config.load(path), applied.append, Metrics())  # type: ignore[arg-type]
    assert watcher.check() is None
    path.write_text(json.dumps({"servedModelName": "m", "tokenizer": "t"}, indent=1))  # same settings, new bytes
    outcome = watcher.check()
    assert outcome is not None and outcome.result == reload.APPLIED and outcome.changed == () and applied == []
    path.unlink()  # mid-swap: nothing to read, nothing changes
    assert watcher.check() is None


async def test_a_drain_waits_as_long_as_the_reloaded_setting_says(reloading, fake_vllm):
    start, write = reloading
    fake_vllm.hold = asyncio.Event()
    guard = await start(drainTimeoutSeconds=300)
    async with aiohttp.ClientSession() as s:
        held = asyncio.create_task(s.post(guard.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}))
        await wait_for(lambda: fake_vllm.running == 1, timeout=5, interval=0.005, what="a request at vLLM")
        write(drainTimeoutSeconds=0.2)
        await until_reloaded(s, guard, "applied")
        assert await asyncio.wait_for(guard.drain(), timeout=5) is False  # gave up after 0.2 s, not 300
        fake_vllm.hold.set()
        (await held).release()
