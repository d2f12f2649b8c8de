"""GPU check: what the fragmentation audit depends on, measured on a real CUDA device.

Needs a CUDA machine and a CUDA build of torch; nothing else (no vLLM, no model,
no network; it refuses to import vLLM). Under 5 minutes on an H100/H200
(``--max-seconds`` caps each engine-shaped run). Every phase runs twice, each time
in a fresh process:

- ``default``: PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's default allocator);
- ``expandable``: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (what the
  operator gives vLLM's container unless the spec says otherwise).

The phases:

1. ``sampling``: the vLLM plugin's sampling (``gpufleet_engine.vllm.plugin.sample``,
   the code that runs inside vLLM in production) against allocations of known
   sizes: its allocated bytes must equal the tensors' sizes as the caching
   allocator rounds them (exactly), its reserved bytes what torch reports, and
   the device's free memory (cudaMemGetInfo) must fall by what the allocator
   reserved when a new segment is taken. It also times one sample (the plugin
   samples every 5 s inside every vLLM process).
2. ``swiss-cheese``: a fragmenting pattern. Fill a capped budget with 6 MiB
   blocks (the default allocator packs three into each 20 MiB segment), free
   every other one, read fragmentation with the plugin, then ask for 12 MiB
   blocks: under the default allocator the holes cannot hold them and the
   segments holding them cannot be returned, so the freed memory is lost
   (allocation retries, OOMs); expandable segments can unmap the holes' pages.
   It prints how much of the freed memory the larger blocks could reuse.
3. ``engine``: an engine-shaped workload: one long-lived "KV pool" taking most
   of a capped budget, then prefill-like activations of heavy-tailed sizes held
   for a random number of steps and freed out of order, sampled with the
   plugin every ``--sample-every`` steps.

    python bench/gpu_fragmentation.py                              # ~2-3 min
    python bench/gpu_fragmentation.py --json reports/gpu_fragmentation.json --record reports/memory_stats

``--record DIR`` also saves the raw ``torch.cuda.memory_stats()`` dictionaries
of the engine phase (tests/fixtures/torch_memory_stats has torch's key layout;
recorded ones can replace those fixtures).

Exit status: 0 when the plugin's readings match the allocator in both modes and
expandable segments fragment less than the default allocator (lower mean
fragmentation in the engine phase, more of the freed memory reused in the
swiss-cheese phase); 1 otherwise (the summary says which); 2 without CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "engine_image"), str(ROOT / "api"), str(ROOT / "kit")]

MODES = {"default": None, "expandable": "expandable_segments:True"}
PHASES = ("sampling", "swiss-cheese", "engine")
MIB = 1 << 20
# The caching allocator's block granularity (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize):
# with roundup_power2_divisions unset, every allocation is rounded up to a multiple of it.
MIN_BLOCK = 512
# How far the device's free memory may differ from what the allocator reserved (the driver's
# own bookkeeping, page tables) before the check calls it a mismatch.
FREE_TOLERANCE = 64 * MIB


class NoVllm:
    """A meta-path finder that fails any import of vLLM: this check must not need it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("bench/gpu_fragmentation.py must not import vLLM")
        return None


# --- pure: what the readings should be, and the verdict ------------------------------


def rounded(size: int) -> int:
    """Bytes the caching allocator books for a request of ``size`` bytes (default config)."""
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def prompt_tokens(rng: random.Random, max_tokens: int) -> int:
    """Heavy-tailed prompt lengths (log-normal, median ~600 tokens), like chat and RAG traffic."""
    return max(16, min(max_tokens, int(rng.lognormvariate(6.4, 1.1))))


def verdict(results: dict[str, dict[str, dict]]) -> tuple[bool, list[str]]:
    """(passed, the lines that say why) from ``results[mode][phase]``."""
    lines, ok = [], True
    for mode in MODES:
        s = results[mode]["sampling"]
        good = s["allocatedMismatchBytes"] == 0 and s["reservedMismatchBytes"] == 0 and \
            abs(s["freeVsReservedBytes"]) <= FREE_TOLERANCE
        ok &= good
        lines.append(f"{mode}: plugin allocated-bytes error {s['allocatedMismatchBytes']} B, reserved error "
                     f"{s['reservedMismatchBytes']} B, device free vs reserved {s['freeVsReservedBytes'] / MIB:+.1f} "
                     f"MiB, {s['sampleMicros']:.0f} us per sample: {'matches' if good else 'MISMATCH'}")
    d, e = results["default"]["swiss-cheese"], results["expandable"]["swiss-cheese"]
    swiss = e["reusedShare"] > d["reusedShare"] or (e["reusedShare"] == d["reusedShare"] == 1.0)
    ok &= swiss
    lines.append(f"swiss-cheese: fragmentation after freeing half {d['fragmentationAfterFree']:.1%} -> "
                 f"{e['fragmentationAfterFree']:.1%}, freed memory reused by 2x blocks {d['reusedShare']:.1%} -> "
                 f"{e['reusedShare']:.1%}, retries {d['allocRetries']} -> {e['allocRetries']}, "
                 f"OOMs {d['ooms']} -> {e['ooms']}: {'expandable reuses more' if swiss else 'NO improvement'}")
    d, e = results["default"]["engine"], results["expandable"]["engine"]
    engine = e["allocRetries"] <= d["allocRetries"] and e["fragmentationMean"] < d["fragmentationMean"]
    ok &= engine
    lines.append(f"engine: fragmentation mean {d['fragmentationMean']:.1%} -> {e['fragmentationMean']:.1%}, "
                 f"max {d['fragmentationMax']:.1%} -> {e['fragmentationMax']:.1%}, retries {d['allocRetries']} -> "
                 f"{e['allocRetries']}, OOMs {d['ooms']} -> {e['ooms']}, steps {d['steps']} / {e['steps']}: "
                 f"{'expandable segments help' if engine else 'NO improvement'}")
    return ok, lines


# --- on the GPU (a child process per mode and phase) ---------------------------------


def _report(torch: Any, device: int) -> dict:
    from gpufleet_engine.vllm import plugin as vllm_plugin

    reports, no_cuda = vllm_plugin.sample(torch, pid=os.getpid(), now=time.time())
    if no_cuda is not None:
        raise RuntimeError(no_cuda["reason"])
    return next(r for r in reports if r["device"] == device)


def phase_sampling(torch: Any, device: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    warm = torch.empty(1, dtype=torch.uint8, device=device)   # the plugin reports only a device in use
    base = _report(torch, device)
    sizes = [rng.choice((1, 100, 511, 512, 513, 4096, 1 << 20, (1 << 20) + 1, 7 << 20, 33 << 20))
             for _ in range(200)]
    tensors = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    torch.cuda.synchronize(device)
    after = _report(torch, device)
    expected = sum(rounded(n) for n in sizes)
    allocated_error = (after["allocatedBytes"] - base["allocatedBytes"]) - expected
    reserved_error = after["reservedBytes"] - torch.cuda.memory_reserved(device)
    # A new segment: the device's free memory must drop by what the allocator reserved.
    free0, reserved0 = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    big = torch.empty(args.big_mib * MIB + 1, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)
    grown = _report(torch, device)
    reserved_delta = grown["reservedBytes"] - reserved0
    free_delta = free0 - grown["freeBytes"]
    started = time.perf_counter()
    for _ in range(args.sample_repeats):
        _report(torch, device)
    micros = (time.perf_counter() - started) / args.sample_repeats * 1e6
    del tensors, big, warm
    return {"tensors": len(sizes), "expectedBytes": expected, "allocatedMismatchBytes": allocated_error,
            "reservedMismatchBytes": reserved_error, "bigAllocationBytes": args.big_mib * MIB + 1,
            "reservedGrowthBytes": reserved_delta, "deviceFreeDropBytes": free_delta,
            "freeVsReservedBytes": free_delta - reserved_delta, "sampleMicros": round(micros, 1)}


def phase_swiss_cheese(torch: Any, device: int, args: argparse.Namespace) -> dict:
    total = torch.cuda.mem_get_info(device)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.swiss_gib * 2**30 / total), device)
    small, large = 6 * MIB, 12 * MIB
    blocks = []
    try:
        while len(blocks) < 100_000:
            blocks.append(torch.empty(small, dtype=torch.uint8, device=device))
    except torch.cuda.OutOfMemoryError:
        pass
    filled = _report(torch, device)
    count = len(blocks)
    freed = 0
    for i in range(0, len(blocks), 2):
        blocks[i] = None
        freed += small
    torch.cuda.synchronize(device)
    holes = _report(torch, device)
    placed = 0
    larger = []
    try:
        while placed + large <= freed:
            larger.append(torch.empty(large, dtype=torch.uint8, device=device))
            placed += large
    except torch.cuda.OutOfMemoryError:
        pass
    end = _report(torch, device)
    del blocks, larger
    return {"budgetBytes": int(args.swiss_gib * 2**30), "blocks": count,
            "filledReservedBytes": filled["reservedBytes"], "freedBytes": freed, "reusedBytes": placed,
            "reusedShare": round(placed / freed, 4) if freed else 0.0,
            "fragmentationAfterFree": holes["fragmentationRatio"] or 0.0,
            "inactiveSplitAfterFreeBytes": holes["inactiveSplitBytes"],
            "allocRetries": end["allocRetries"], "ooms": end["ooms"]}


def phase_engine(torch: Any, device: int, args: argparse.Namespace) -> dict:
    torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
    total = torch.cuda.mem_get_info(device)[1]
    budget = int(total * args.memory_fraction)
    rng = random.Random(args.seed)
    kv_pool = torch.empty(int(budget * args.kv_share), dtype=torch.uint8, device=device)
    live: list[tuple[int, Any]] = []   # (step to free at, activation)
    samples, records = [], []
    ooms_caught = 0
    start = time.monotonic()
    step = 0
    for step in range(args.steps):
        live = [(until, t) for until, t in live if until > step]   # free what is due, out of order
        size = prompt_tokens(rng, args.max_prompt_tokens) * args.bytes_per_token
        try:
            live.append((step + rng.randint(1, args.max_hold_steps),
                         torch.empty(size, dtype=torch.uint8, device=device)))
            # A few small, longer-lived tensors (sampling state, logits) between the big ones.
            live.append((step + rng.randint(args.max_hold_steps, 4 * args.max_hold_steps),
                         torch.empty(rng.randint(1, 64) * MIB, dtype=torch.uint8, device=device)))
        except torch.cuda.OutOfMemoryError:
            ooms_caught += 1
            live.sort(key=lambda item: item[0])
            live = live[len(live) // 2:]   # the engine would preempt: drop half the batch
        over = time.monotonic() - start > args.max_seconds
        if step % args.sample_every == 0 or step == args.steps - 1 or over:
            torch.cuda.synchronize(device)
            report = _report(torch, device)
            samples.append((step, report))
            if args.record:
                records.append({"step": step, "free_bytes": report["freeBytes"],
                                "total_bytes": report["totalBytes"], "stats": torch.cuda.memory_stats(device)})
        if over:
            break
    seconds = time.monotonic() - start
    del kv_pool, live
    ratios = [r["fragmentationRatio"] or 0.0 for _, r in samples]
    last = samples[-1][1]
    if args.record:
        out = Path(args.record)
        out.mkdir(parents=True, exist_ok=True)
        mode = "expandable" if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") else "default"
        (out / f"{mode}.json").write_text(json.dumps({"samples": records}))
    return {"budgetBytes": budget, "steps": step + 1, "stoppedByTimeCap": step + 1 < args.steps,
            "stepsPerSecond": round((step + 1) / seconds, 1),
            "fragmentationMean": round(sum(ratios) / len(ratios), 4), "fragmentationMax": round(max(ratios), 4),
            "fragmentationLast": round(ratios[-1], 4),
            "inactiveSplitBytesMax": max(r["inactiveSplitBytes"] for _, r in samples),
            "reservedBytesLast": last["reservedBytes"], "allocRetries": last["allocRetries"],
            "ooms": last["ooms"], "oomsCaught": ooms_caught,
            "series": [[s, round(r["fragmentationRatio"] or 0.0, 4), r["allocRetries"]] for s, r in samples]}


def child(args: argparse.Namespace) -> dict:
    sys.meta_path.insert(0, NoVllm())
    import torch

    if not torch.version.cuda or not torch.cuda.is_available():
        return {"error": f"no CUDA device (torch {torch.__version__}, CUDA build: {bool(torch.version.cuda)})"}
    device = 0
    torch.cuda.set_device(device)
    run = {"sampling": phase_sampling, "swiss-cheese": phase_swiss_cheese, "engine": phase_engine}[args.phase]
    started = time.monotonic()
    result = run(torch, device, args)
    return {"phase": args.phase, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda, "allocatorConfig": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "seconds": round(time.monotonic() - started, 2), **result}


# --- the parent ----------------------------------------------------------------------


def run_child(mode: str, phase: str, argv: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if MODES[mode]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = MODES[mode]
    done = subprocess.run([sys.executable, __file__, "--child", "--phase", phase, *argv], env=env,
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=3000, help="engine phase: allocation steps")
    p.add_argument("--max-seconds", type=float, default=60.0, help="engine phase: stop after this long")
    p.add_argument("--memory-fraction", type=float, default=0.5, help="engine phase: budget, share of the GPU")
    p.add_argument("--kv-share", type=float, default=0.55, help="engine phase: share of the budget for the KV pool")
    p.add_argument("--bytes-per-token", type=int, default=256 << 10,
                   help="engine phase: activation bytes per prompt token (hidden size x dtype x live buffers)")
    p.add_argument("--max-prompt-tokens", type=int, default=16384)
    p.add_argument("--max-hold-steps", type=int, default=12)
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--swiss-gib", type=float, default=4.0, help="swiss-cheese phase: budget in GiB")
    p.add_argument("--big-mib", type=int, default=1024, help="sampling phase: the new segment's size")
    p.add_argument("--sample-repeats", type=int, default=200, help="sampling phase: samples timed")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--record", help="save the engine phase's raw memory_stats() dictionaries here")
    p.add_argument("--json", help="write every run here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    forwarded = list(argv)
    if "--json" in forwarded:
        i = forwarded.index("--json")
        del forwarded[i:i + 2]
    started = time.monotonic()
    results: dict[str, dict[str, dict]] = {mode: {} for mode in MODES}
    for phase in PHASES:
        for mode in MODES:
            r = results[mode][phase] = run_child(mode, phase, forwarded)
            print(mode, phase, json.dumps({k: v for k, v in r.items() if k != "series"}), flush=True)
            if "error" in r:
                print(f"{mode} {phase}: {r['error']}", file=sys.stderr)
                return 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    passed, lines = verdict(results)
    for line in lines:
        print(line)
    print(f"{'PASS' if passed else 'FAIL'} in {time.monotonic() - started:.0f}s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
