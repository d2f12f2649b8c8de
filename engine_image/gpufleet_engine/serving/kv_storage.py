"""The guard's side task on a pod that writes the shared-storage connector's KV files: every
``PASS_SECONDS`` the directory is bounded (vllm/shared_storage.py), off the event loop, and its
size and removals counted.

The directory is the one vLLM writes (``engine.kvTransfer.extraConfig.shared_storage_path``):
the guard's container mounts the same volume at the same path. Where it cannot read it, the
guard says so in its log, once per problem, and keeps serving: an unbounded directory fills
its volume slowly, a guard that stopped would refuse every request now.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from gpufleet_engine.serving.prometheus import GuardMetrics
from gpufleet_engine.vllm import shared_storage

log = logging.getLogger("gpufleet_engine.serving.kv_storage")

PASS_SECONDS = 10.0


async def keep_bounded(directory: Path, limit_bytes: int, metrics: GuardMetrics,
                       interval: float = PASS_SECONDS) -> None:
    """Bound ``directory`` to ``limit_bytes`` now and every ``interval`` seconds, until cancelled."""
    log.info("keeping the KV connector's files in %s under %d bytes", directory, limit_bytes)
    problem = ""
    while True:
        try:
            done = await asyncio.to_thread(shared_storage.bound, directory, limit_bytes, time.time())
        except OSError as e:
            metrics.kv_storage_bytes = None
            if str(e) != problem:
                problem = str(e)
                log.warning("cannot bound the KV connector's directory %s (%s); mount the volume the "
                            "engine writes its KV files to at the same path in the guard's container",
                            directory, e)
        else:
            problem = ""
            metrics.kv_storage_bytes = done.size_bytes
            if done.removed:
                metrics.kv_storage_removed_prompts.inc(done.removed)
                log.info("removed the KV files of %d prompts from %s: %d bytes left (limit %d)",
                         done.removed, directory, done.size_bytes, limit_bytes)
        await asyncio.sleep(interval)
