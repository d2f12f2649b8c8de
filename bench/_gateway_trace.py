"""The trace and the figures of bench/gateway_pickers.py, pure (tests/unit/bench/test_gateway_pickers_bench.py).

The trace: a prefix-heavy chat workload. ``apps`` chat applications, each a long system prompt of its own
(about 20 KV blocks of 32 tokens on the tiny model), half of them served by the base model and half through
one of the LoRA adapters (a team's fine-tune with its own prompt); which application a request comes from is
Zipf-distributed, arrivals are Poisson (open loop: a request leaves at its time whatever the earlier ones
are doing), the user's turn is short and new every time, and answers run to a length drawn per request.
"""
from __future__ import annotations

import dataclasses
import math
import random

WORDS = ("invoice refund shipping warranty helmet lock frame wheel brake chain saddle pedal gear tyre light "
         "basket bell pump mirror rack").split()


@dataclasses.dataclass(frozen=True)
class App:
    system: str
    model: str


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    at: float        # seconds after the trace starts
    app: int
    model: str
    system: str
    user: str
    max_tokens: int


def apps(count: int, base: str, adapters: list[str], words: int, seed: int) -> list[App]:
    """``count`` applications; the odd ones go through the adapters in turn, the even ones the base model."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        model = adapters[(i // 2) % len(adapters)] if adapters and i % 2 else base
        text = f"You are assistant {i} of team {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(App(text, model))
    return out


def zipf(n: int, s: float) -> list[float]:
    return [1.0 / (k ** s) for k in range(1, n + 1)]


def trace(seed: int, applications: list[App], requests: int, rate: float, zipf_s: float = 0.8,
          answer_median: int = 24) -> list[ChatRequest]:
    rng = random.Random(seed)
    order = list(range(len(applications)))
    rng.shuffle(order)  # popularity does not follow base/adapter order
    weights = zipf(len(order), zipf_s)
    out, at = [], 0.0
    for i in range(requests):
        at += rng.expovariate(rate)
        app = rng.choices(order, weights)[0]
        answer = max(4, min(4 * answer_median, round(rng.lognormvariate(math.log(answer_median), 0.6))))
        user = f"Ticket {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "?"
        out.append(ChatRequest(at, app, applications[app].model, applications[app].system, user, answer))
    return out


@dataclasses.dataclass
class Outcome:
    status: int | None = None      # HTTP status; None when the connection failed
    ttft: float | None = None      # seconds to the first streamed chunk
    tokens: int = 0
    error: str | None = None


def pct(values: list[float], q: float) -> float:
    """The q-quantile by the nearest rank (NaN for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarise(outcomes: list[Outcome], wall_s: float, hits: float, queries: float, ttft_slo_s: float,
              pick_us: list[int], sent: int | None = None) -> dict:
    ok = [o for o in outcomes if o.status == 200 and o.error is None]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    good = sum(1 for t in ttfts if t <= ttft_slo_s)
    refused = sum(1 for o in outcomes if o.status == 429)
    errors = [o for o in outcomes if not (o.status == 200 and o.error is None) and o.status != 429]
    return {
        "requests": len(outcomes) if sent is None else sent, "ok": len(ok), "good": good,
        "refused_429": refused, "errors": len(errors),
        "first_errors": [f"{o.status} {o.error}" for o in errors][:3],
        "hit_rate": hits / queries if queries else 0.0, "prefix_hits_tokens": hits, "prefix_queries_tokens": queries,
        "ttft_p50_ms": pct(ttfts, 0.5) * 1000, "ttft_p99_ms": pct(ttfts, 0.99) * 1000,
        "goodput_rps": good / wall_s if wall_s else 0.0, "wall_s": wall_s,
        "pick_p50_us": pct([float(x) for x in pick_us], 0.5), "pick_p99_us": pct([float(x) for x in pick_us], 0.99),
        "picks_timed": len(pick_us),
    }


def ratios(results: dict[str, dict], arm: str, against: str) -> dict[str, float]:
    a, b = results[arm], results[against]

    def ratio(x: float, y: float) -> float:
        return x / y if y else float("inf") if x else float("nan")
    return {"ttft_p99": ratio(a["ttft_p99_ms"], b["ttft_p99_ms"]),
            "ttft_p50": ratio(a["ttft_p50_ms"], b["ttft_p50_ms"]),
            "goodput": ratio(a["goodput_rps"], b["goodput_rps"]), "hit_rate": ratio(a["hit_rate"], b["hit_rate"])}


def target(results: dict[str, dict], ours: str, peers: list[str]) -> dict[str, bool | None]:
    """Issue 46: ours ahead of every peer that ran on TTFT p99 and goodput, at or above on hit rate."""
    ran = [p for p in peers if p in results]
    if ours not in results or not ran:
        return {"ttft_p99 below the peers'": None, "goodput above the peers'": None, "hit rate at or above": None}
    me = results[ours]
    return {"ttft_p99 below the peers'": all(me["ttft_p99_ms"] < results[p]["ttft_p99_ms"] for p in ran),
            "goodput above the peers'": all(me["goodput_rps"] > results[p]["goodput_rps"] for p in ran),
            "hit rate at or above": all(me["hit_rate"] >= results[p]["hit_rate"] for p in ran)}
