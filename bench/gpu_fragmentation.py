"""GPU check: PyTorch caching-allocator fragmentation with and without expandable segments.

Needs a CUDA machine and a CUDA build of torch; nothing else (no vLLM, no model,
no network). Runs the same workload twice, each in a fresh process:

- ``default``: PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's default allocator);
- ``expandable``: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (what the
  operator gives vLLM's container unless the spec says otherwise).

The workload is shaped like an engine's, not like the metric: one long-lived
"KV pool" allocation taking most of a capped budget
(``torch.cuda.set_per_process_memory_fraction``), then prefill-like activations
whose sizes follow heavy-tailed prompt lengths, held for a random number of
steps and freed out of order. Every ``--sample-every`` steps it reads the
allocator exactly as the vLLM plugin does in production
(``gpufleet_engine.vllm.plugin.sample``: the same fields, the same
fragmentation definition) and prints one JSON line per mode with the
fragmentation ratio (mean, max, last), allocation retries, OOMs and steps/s.
``--record DIR`` also saves the raw ``torch.cuda.memory_stats()`` dictionaries
(the unit tests' fixtures in tests/fixtures/torch_memory_stats have torch's
key layout; recorded ones can replace them).

    python bench/gpu_fragmentation.py                       # ~1-2 min on an H100/H200
    python bench/gpu_fragmentation.py --steps 4000 --json reports/gpu_fragmentation.json

It does not start vLLM: the engine's own activations are what this imitates.
Exit status 0 when the expandable run shows fewer retries and lower mean
fragmentation than the default run, 1 otherwise, 2 without CUDA.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine_image"))

MODES = {"default": None, "expandable": "expandable_segments:True"}


def prompt_tokens(rng: random.Random, max_tokens: int) -> int:
    """Heavy-tailed prompt lengths (log-normal, median ~600 tokens), like chat and RAG traffic."""
    return max(16, min(max_tokens, int(rng.lognormvariate(6.4, 1.1))))


def workload(args: argparse.Namespace) -> dict:
    import torch

    from gpufleet_engine.vllm import plugin as vllm_plugin

    if not torch.cuda.is_available():
        return {"error": "no CUDA device"}
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
    free, total = torch.cuda.mem_get_info(device)
    budget = int(total * args.memory_fraction)
    rng = random.Random(args.seed)
    kv_pool = torch.empty(int(budget * args.kv_share), dtype=torch.uint8, device=device)
    live: list[tuple[int, torch.Tensor]] = []   # (step to free at, activation)
    samples, records = [], []
    ooms_caught = 0
    start = time.monotonic()
    for step in range(args.steps):
        # Free what is due, out of allocation order.
        live = [(until, t) for until, t in live if until > step]
        tokens = prompt_tokens(rng, args.max_prompt_tokens)
        size = tokens * args.bytes_per_token
        try:
            live.append((step + rng.randint(1, args.max_hold_steps),
                         torch.empty(size, dtype=torch.uint8, device=device)))
            # A few small, longer-lived tensors (sampling state, logits) between the big ones.
            live.append((step + rng.randint(args.max_hold_steps, 4 * args.max_hold_steps),
                         torch.empty(rng.randint(1, 64) << 20, dtype=torch.uint8, device=device)))
        except torch.cuda.OutOfMemoryError:
            ooms_caught += 1
            live.sort(key=lambda item: item[0])
            live = live[len(live) // 2:]   # the engine would preempt: drop half the batch
        if step % args.sample_every == 0 or step == args.steps - 1:
            torch.cuda.synchronize(device)
            reports, _ = vllm_plugin.sample(torch, pid=os.getpid(), now=time.time())
            report = next(r for r in reports if r["device"] == 0)
            samples.append(report)
            if args.record:
                records.append({"step": step, "free_bytes": report["freeBytes"],
                                "total_bytes": report["totalBytes"], "stats": torch.cuda.memory_stats(device)})
    seconds = time.monotonic() - start
    del kv_pool
    ratios = [s["fragmentationRatio"] or 0.0 for s in samples]
    last = samples[-1]
    result = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "allocatorConfig": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "budgetBytes": budget, "steps": args.steps, "stepsPerSecond": round(args.steps / seconds, 1),
        "fragmentationMean": round(sum(ratios) / len(ratios), 4), "fragmentationMax": round(max(ratios), 4),
        "fragmentationLast": round(ratios[-1], 4),
        "inactiveSplitBytesMax": max(s["inactiveSplitBytes"] for s in samples),
        "reservedBytesLast": last["reservedBytes"], "allocRetries": last["allocRetries"],
        "ooms": last["ooms"], "oomsCaught": ooms_caught,
        "series": [[i * args.sample_every, round(r, 4), s["allocRetries"]]
                   for i, (r, s) in enumerate(zip(ratios, samples))],
    }
    if args.record:
        out = Path(args.record)
        out.mkdir(parents=True, exist_ok=True)
        mode = "expandable" if result["allocatorConfig"] else "default"
        (out / f"{mode}.json").write_text(json.dumps({"about": result, "samples": records}))
    return result


def run_mode(mode: str, argv: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if MODES[mode]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = MODES[mode]
    done = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--memory-fraction", type=float, default=0.5, help="allocator budget, share of the GPU")
    p.add_argument("--kv-share", type=float, default=0.55, help="share of the budget taken by the KV pool")
    p.add_argument("--bytes-per-token", type=int, default=256 << 10,
                   help="activation bytes per prompt token (hidden size x dtype x live buffers)")
    p.add_argument("--max-prompt-tokens", type=int, default=16384)
    p.add_argument("--max-hold-steps", type=int, default=12)
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--record", help="save the raw memory_stats() dictionaries here")
    p.add_argument("--json", help="write both runs here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.child:
        print(json.dumps(workload(args)))
        return 0
    forwarded = [a for a in argv if a != "--child"]
    if "--json" in forwarded:
        i = forwarded.index("--json")
        del forwarded[i:i + 2]
    results = {mode: run_mode(mode, forwarded) for mode in MODES}
    for mode, r in results.items():
        print(mode, json.dumps({k: v for k, v in r.items() if k != "series"}))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    if any("error" in r for r in results.values()):
        return 2
    d, e = results["default"], results["expandable"]
    better = e["allocRetries"] <= d["allocRetries"] and e["fragmentationMean"] < d["fragmentationMean"]
    print(f"fragmentation mean {d['fragmentationMean']:.1%} -> {e['fragmentationMean']:.1%}, "
          f"allocation retries {d['allocRetries']} -> {e['allocRetries']}, OOMs {d['ooms']} -> {e['ooms']}: "
          f"{'expandable segments help' if better else 'NO improvement'}")
    return 0 if better else 1


if __name__ == "__main__":
    sys.exit(main())
