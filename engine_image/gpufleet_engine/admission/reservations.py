"""What one admitted request holds in the KV ledger, and how the guard sizes it.

A reservation is the request's output tokens per sequence: the learned mean
and its variance where ``reservation`` is Predicted (demand.py), else the
request's whole budget. An answer that streams past its reservation grows it
to what answers that long went on to use; a finished answer's length joins
the distribution. Pure: the caller (serving/guard.py) counts the metrics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gpufleet_engine.admission import kv_handoff
from gpufleet_engine.admission.context import Prepared


class Reservation:
    """What one admitted request holds in the ledger, in output tokens per sequence, and how far
    its answer has streamed (SSE events per sequence: about one token each)."""

    def __init__(self, key: tuple[str, str], prepared: Prepared, reserved_output: int,
                 variance: float = 0.0):
        self.key = key
        self.prepared = prepared
        self.sequences = len(prepared.prompt_tokens) * prepared.sequences_per_prompt
        self.initial_output = reserved_output
        self.output = reserved_output
        self.variance = variance   # tokens² per sequence, around ``output``
        # Extend when this many events have streamed back (every sequence's share of its reservation).
        # A prefill's reservation is exact (its budget less the token it hands on): never extended.
        extendable = reserved_output < prepared.max_tokens and prepared.phase != kv_handoff.PREFILL
        self.next_extension = reserved_output * self.sequences if extendable else -1
        self.events = 0

    def cost(self, block_size: int) -> int:
        """Blocks the request holds: its prompts and its reserved output."""
        return self.prepared.block_cost(block_size, self.output)

    def block_variance(self, block_size: int) -> float:
        """The variance of the reservation in blocks²: its sequences' answers vary independently."""
        return self.sequences * self.variance / block_size ** 2

    def computed_prompt_tokens(self, block_size: int) -> int:
        """Prompt tokens vLLM computes for the request: all of them, except what a decode loads
        from the prefill's hand-off (kv_handoff.py)."""
        phase = self.prepared.phase
        return sum(kv_handoff.computed_prompt_tokens(phase, p, block_size)
                   for p in self.prepared.prompt_tokens)

    def start_tokens(self, block_size: int) -> int:
        """The prompt tokens the request starts with, for the TTFT control's start bound, when its
        first token will be reported: a streamed request's, and a prefill's (its whole answer is
        its first token). 0 for other requests."""
        if not (self.prepared.stream or self.prepared.phase == kv_handoff.PREFILL):
            return 0
        return self.computed_prompt_tokens(block_size)


@dataclass(frozen=True)
class Learned:
    """A finished answer's length per sequence, the ratio to what was first reserved, and the
    prediction for its key now (None while too few answers were seen)."""
    per_sequence: int
    ratio: float
    predicted: float | None


def per_sequence(reservation: Reservation, completion_tokens: int) -> int:
    return math.ceil(completion_tokens / reservation.sequences)
