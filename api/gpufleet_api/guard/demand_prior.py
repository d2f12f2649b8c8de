"""``demand.json``: the output lengths a service's replicas have learned, handed to its new ones.

A guard reserves KV blocks for an answer from the lengths of the answers it
has streamed back (``demand.py``). Until it has seen ``MIN_SAMPLES`` of a
(route, class) it reserves the whole budget: safe, and for chat clients that
send no ``max_tokens`` (the rest of the context) it refuses most of what a
warm replica admits. A replica added by a scale-out meets its first traffic
exactly when the service is busiest, so it starts from what the service
already knows instead:

- every guard answers ``GET /demand`` (``DEMAND_PATH``) with this document of
  its learned keys, each as the lengths of its recent window (at most
  ``POINTS``) and the number of answers behind them;
- the operator reads it from the service's ready replicas, pools them
  (``merge``, weighted by those numbers) and writes the result as the
  ``demand.json`` key of the service's guard ConfigMap, beside ``guard.json``
  (its own field manager; only when the distribution moved, ``differs``);
- a guard starting in a new pod reads ``demand.json`` next to its
  ``guard.json`` once and seeds every key it has not learned itself. Its own
  answers then replace the seeded points as its window fills.

With the lengths goes how many KV blocks a request in flight holds on
average (``HeldPerRequest``: the ledger's decayed average over its recent
metrics reads, and the weight of the reads behind it). A new guard's overload
gate otherwise judges a burst's first moment by the few requests running then
(``scheduler.overloaded``), and a first burst of long prompts made it act and
refuse a quarter of a load the warm replica served without a refusal.

Pure: no I/O beyond what a caller hands in.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..errors import ContractError

FILE_NAME = "demand.json"
DEMAND_PATH = "/demand"
# Quantiles kept per key: a guard's whole window (demand.WINDOW), about 2 KB of JSON. Fewer lose the
# long tail that carries most of the variance behind the ledger's margin: from 64 evenly spaced
# quantiles of skewed real answers the variance came out 30% low, from 256 25% high.
POINTS = 512
# A pooled mean that moved less than this share from the one last written is not worth a write.
MEAN_CHANGE = 0.1
VERSION = 1


class PriorError(ContractError):
    """``demand.json`` is invalid; ``problems`` names each field that is wrong."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid demand.json:\n  - " + "\n  - ".join(problems))


@dataclass(frozen=True)
class KeyPrior:
    """One (route, queue class): ``samples`` answers, summarised as sorted ``lengths`` (tokens per
    sequence), each standing for an equal share of them."""
    route: str
    queue_class: str
    samples: int
    lengths: tuple[int, ...]

    @property
    def key(self) -> tuple[str, str]:
        return (self.route, self.queue_class)

    @property
    def mean(self) -> float:
        return sum(self.lengths) / len(self.lengths)


@dataclass(frozen=True)
class HeldPerRequest:
    """KV blocks a request in flight held on average, over reads that saw ``weight`` requests in
    flight (decayed): what one more request asking is expected to take."""
    blocks: float
    weight: float


@dataclass(frozen=True)
class DemandPrior:
    keys: tuple[KeyPrior, ...] = ()
    held: HeldPerRequest | None = None

    def by_key(self) -> dict[tuple[str, str], KeyPrior]:
        return {k.key: k for k in self.keys}


def key_prior(route: str, queue_class: str, sorted_lengths: list[int]) -> KeyPrior:
    """One key as a guard exports it: its window of lengths (``demand.WINDOW``, the size of
    ``POINTS``) as it is."""
    return KeyPrior(route, queue_class, len(sorted_lengths), tuple(sorted_lengths))


def merge(priors: Iterable[DemandPrior], points: int = POINTS) -> DemandPrior:
    """Several replicas' priors as one: per key, the quantiles of all their points pooled, each
    point weighted by the answers it stands for (a replica that saw 500 answers counts 50 times
    one that saw 10)."""
    priors = list(priors)
    pooled: dict[tuple[str, str], list[tuple[int, float]]] = {}
    totals: dict[tuple[str, str], int] = {}
    for prior in priors:
        for k in prior.keys:
            if not k.lengths or k.samples <= 0:
                continue
            weight = k.samples / len(k.lengths)
            pooled.setdefault(k.key, []).extend((length, weight) for length in k.lengths)
            totals[k.key] = totals.get(k.key, 0) + k.samples
    out = []
    for key in sorted(pooled):
        weighted = sorted(pooled[key])
        count = min(points, len(weighted))
        cumulative: list[float] = []
        running = 0.0
        for _, w in weighted:
            running += w
            cumulative.append(running)
        lengths = tuple(weighted[min(len(weighted) - 1, bisect.bisect_left(cumulative, (i + 0.5) * running / count))][0]
                        for i in range(count))
        out.append(KeyPrior(key[0], key[1], totals[key], lengths))
    return DemandPrior(tuple(out), _pooled_held([p.held for p in priors if p.held is not None]))


def _pooled_held(held: list[HeldPerRequest]) -> HeldPerRequest | None:
    """The replicas' averages weighted by the reads behind them, with one replica's weight (their
    mean): a new replica's own reads then outweigh it as fast as they would a replica's own past."""
    weight = sum(h.weight for h in held)
    if weight <= 0:
        return None
    return HeldPerRequest(sum(h.blocks * h.weight for h in held) / weight, weight / len(held))


def differs(new: DemandPrior, old: DemandPrior | None) -> bool:
    """Whether ``new`` is worth writing over ``old``: a key appeared, or a key's mean or the blocks
    held per request moved by ``MEAN_CHANGE`` or more."""
    if old is None:
        return bool(new.keys) or new.held is not None
    if new.held is not None and (old.held is None or abs(new.held.blocks - old.held.blocks)
                                 >= MEAN_CHANGE * max(1.0, old.held.blocks)):
        return True
    before = old.by_key()
    for k in new.keys:
        was = before.get(k.key)
        if was is None or abs(k.mean - was.mean) >= MEAN_CHANGE * max(1.0, was.mean):
            return True
    return False


def to_document(prior: DemandPrior) -> dict:
    doc: dict = {"version": VERSION, "keys": [
        {"route": k.route, "class": k.queue_class, "samples": k.samples, "lengths": list(k.lengths)}
        for k in prior.keys]}
    if prior.held is not None:
        doc["heldPerRequest"] = {"blocks": round(prior.held.blocks, 3), "weight": round(prior.held.weight, 3)}
    return doc


def parse(raw: Any) -> DemandPrior:
    """Validate a decoded ``demand.json``; raise PriorError naming every wrong field."""
    problems: list[str] = []
    if not isinstance(raw, Mapping):
        raise PriorError(["demand.json: must be a JSON object with a 'keys' list"])
    if raw.get("version") != VERSION:
        problems.append(f"version: {raw.get('version')!r} is not {VERSION}; this guard reads version {VERSION}")
    entries = raw.get("keys")
    if not isinstance(entries, list):
        raise PriorError([*problems, "keys: must be a list of {route, class, samples, lengths}"])
    out = []
    for i, entry in enumerate(entries):
        where = f"keys[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: must be an object {{route, class, samples, lengths}}")
            continue
        route, queue_class = entry.get("route"), entry.get("class")
        samples, lengths = entry.get("samples"), entry.get("lengths")
        bad = len(problems)
        for name, value in (("route", route), ("class", queue_class)):
            if not isinstance(value, str) or not value:
                problems.append(f"{where}.{name}: must be a non-empty string")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            problems.append(f"{where}.samples: must be an integer of at least 1, got {samples!r}")
        if not isinstance(lengths, list) or not lengths or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths):
            problems.append(f"{where}.lengths: must be a non-empty list of token counts (integers ≥ 0)")
        if len(problems) == bad and isinstance(samples, int) and isinstance(lengths, list):
            out.append(KeyPrior(str(route), str(queue_class), samples, tuple(sorted(lengths))))
    held = _held(raw.get("heldPerRequest"), problems)
    if problems:
        raise PriorError(problems)
    return DemandPrior(tuple(out), held)


def _held(raw: Any, problems: list[str]) -> HeldPerRequest | None:
    if raw is None:
        return None
    values = []
    for name in ("blocks", "weight"):
        value = raw.get(name) if isinstance(raw, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            problems.append(f"heldPerRequest.{name}: must be a number greater than 0, got {value!r}")
        else:
            values.append(float(value))
    return HeldPerRequest(*values) if len(values) == 2 else None
