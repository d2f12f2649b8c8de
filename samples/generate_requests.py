"""Writes samples/requests.jsonl: 300 synthetic chat requests over ten minutes,
with a two-minute burst, for trying `gpufleet plan --log samples/requests.jsonl`.

Deterministic (fixed seed), so rerunning it reproduces the file byte for byte;
tests/unit/planning checks that. Run: python samples/generate_requests.py
"""
from __future__ import annotations

import json
import math
import random
from datetime import datetime, timedelta, timezone
from pathlib import Path

START = datetime(2025, 6, 2, 9, 0, 0, tzinfo=timezone.utc)
# (until second, arrivals per second): steady, a burst, then quieter.
PHASES = ((240, 0.4), (360, 1.0), (600, 0.35))
REQUESTS = 300


def _lognormal_tokens(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rng.gauss(0, sigma)))))


def generate() -> list[str]:
    rng = random.Random(20250602)
    lines, t = [], 0.0
    while len(lines) < REQUESTS:
        rate = next((r for until, r in PHASES if t < until), PHASES[-1][1])
        t += rng.expovariate(rate)
        prompt = _lognormal_tokens(rng, 600, 0.8, 16, 8000)
        output = _lognormal_tokens(rng, 180, 0.7, 1, 2000)
        # Roughly what one H100 replica of an 8B model does: a short prefill, ~15 ms per output token.
        latency = 0.04 + prompt / 20000 + output * rng.uniform(0.012, 0.018)
        stamp = (START + timedelta(seconds=t)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        lines.append(json.dumps({"timestamp": stamp, "prompt_tokens": prompt, "output_tokens": output,
                                 "latency_seconds": round(latency, 3)}))
    return lines


def main() -> None:
    path = Path(__file__).with_name("requests.jsonl")
    path.write_text("\n".join(generate()) + "\n", encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
