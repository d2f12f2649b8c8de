"""Run the benchmark suite and write the results table into docs/benchmarks.md.

    .venv/bin/python bench/run_all.py [--only guard operator ...]

Each benchmark measures its own baseline in the same run and prints its
table; this runner collects them, with the machine description, between the
markers in docs/benchmarks.md. Run it with nothing else on the machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench:run_all:begin -->", "<!-- bench:run_all:end -->"

SUITE = [
    ("Guard overhead vs a plain pass-through proxy and direct vLLM", ["bench/guard_overhead.py"]),
    ("Tracing in the guard: on at the default sampling vs off", ["bench/guard_tracing_overhead.py"]),
    ("Tracing's cost a request by sampling design (no engine)", ["bench/tracing_cost.py"]),
    ("Tracing in the router: on at the default sampling vs off (no engine)", ["bench/router_tracing_overhead.py"]),
    ("Overload protection: guard vs unguarded vLLM vs vLLM's own shedding", ["bench/guard_overload.py"]),
    ("Real traffic: answers that end early, guard vs vLLM alone", ["bench/guard_realistic.py"]),
    ("Recovery: a surge, a lull, then a burst from clients that do not retry", ["bench/guard_recovery.py"]),
    ("Tenants at a saturated guard: a quiet tenant beside one sending 10x, fair lane vs FCFS",
     ["bench/tenant_fairness.py"]),
    ("A new replica's first minute: cold, seeded from the service, warm", ["bench/guard_scaleout.py"]),
    ("Prefill/decode: unified x2, P/D behind gpufleet's router and behind vllm-router", ["bench/pd_disaggregation.py"]),
    ("LoRA adapters: placement by traffic vs round robin over every adapter", ["bench/lora_placement.py"]),
    ("Streams that survive a dying replica: resumption on vs off", ["bench/stream_resumption.py"]),
    ("Autoscaler decision latency (watermark breach → Deployment change)", ["bench/autoscaler_latency.py"]),
    ("Operator scale (N InferenceServices on simulated nodes)", ["bench/operator_scale.py", "--n", "100"]),
    ("The operator's own CPU, requests and memory at N=1000, no cluster",
     ["bench/operator_inprocess.py", "--n", "1000", "--kopf"]),
    ("Takeover at scale: Lease acquired → first scale-out, warm vs cold follower (1000 services)",
     ["bench/takeover_scale.py"]),
    ("Router discovery: watch vs listing every 2 s (1000 services, simulated pods)", ["bench/router_discovery.py"]),
    ("Status writes of busy services: figures every change vs every 20 s", ["bench/status_writes.py", "--n", "100"]),
]


def machine() -> str:
    mem = ""
    try:
        kb = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, StopIteration):
        pass
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "?")
    return (f"{os.cpu_count()} cores ({cpu}){mem}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", nargs="*", help="substrings of benchmark titles to run")
    args = p.parse_args()
    sections = [f"Machine: {machine()}; run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", ""]
    failed = 0
    for title, cmd in SUITE:
        if args.only and not any(o.lower() in title.lower() for o in args.only):
            continue
        print(f"== {title}", flush=True)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
        print(proc.stdout[-4000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
        failed += proc.returncode != 0
        sections += [f"### {title}", "", f"`{' '.join(cmd)}` — {time.monotonic() - started:.0f} s, "
                     f"exit {proc.returncode}", "", "```", proc.stdout.strip()[-3000:], "```", ""]
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    block = "\n".join([BEGIN, *sections, END])
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Latest full run (`bench/run_all.py`)\n\n" + block + "\n"
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
