"""``Admission``: the guard's admission core in one object, configured in one place.

It holds the KV ledger, the demand model, the queue, the scheduler with its
TTFT control, the tenants its fair lanes are keyed on, the retry hints, the
parse lane and the context limits, and
decides with them: what a request costs, what it reserves, whether it may
ever fit, its grant, its growth, what its answer taught. ``configure(config)``
puts a guard.json into effect: ``__init__`` calls it, and so does every live
reload (serving/reload.py), so a new live admission field is one edit here.
No sockets, no metrics: the HTTP layer (gpufleet_engine.serving) calls in,
never the other way round.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from gpufleet_api.guard.guard_config import GuardConfig, QueueClass
from gpufleet_api.guard.guard_metrics import Reason
from gpufleet_api.tenants.declaration import UNKNOWN_TENANT
from gpufleet_engine.admission import kv_handoff, route_costs
from gpufleet_engine.admission.context import Limits, Prepared
from gpufleet_engine.admission.demand import Demand, OutputPredictor
from gpufleet_engine.admission.grants import Grant, Rejection
from gpufleet_engine.admission.kv_ledger import KvLedger, KvSnapshot
from gpufleet_engine.admission.parse_lane import ParseLane
from gpufleet_engine.admission.queues import MultiLevelQueue
from gpufleet_engine.admission.reservations import Learned, Reservation, per_sequence
from gpufleet_engine.admission.retry_hint import RetryAdvisor
from gpufleet_engine.admission.scheduler import Scheduler
from gpufleet_engine.admission.tenant_keys import TenantKeys
from gpufleet_engine.admission.tokens import Tokenizer
from gpufleet_engine.admission.ttft_limit import ttft_limit_for

# The body limit: a prompt of maxContextTokens tokens takes at most ~12 bytes
# a token as JSON (escaped text or token ids); 64 leaves room for message
# structure, tools and small batches, and 1 MiB for everything else.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_FLOOR = 1024 * 1024


def max_body_bytes(max_context_tokens: int) -> int:
    """The largest request body the guard reads (413 beyond), derived from the context limit."""
    return BODY_BYTES_FLOOR + BODY_BYTES_PER_TOKEN * max_context_tokens


class Admission:
    def __init__(self, config: GuardConfig, tokenizer: Tokenizer | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_context_warning: Callable[[int, int], None] = lambda configured, served: None):
        self.clock = clock
        self.tokenizer = tokenizer
        # The context vLLM serves: engine.maxModelLen, else read from its /v1/models (served_context.py).
        self.served_context: int | None = config.engine.max_model_len if config.engine else None
        self.default_max_tokens: int | None = None
        self.limits: Limits | None = None
        self.max_body_bytes = max_body_bytes(0)
        self.engine_block_size: int | None = None   # vLLM's, once read; else guard.json's
        self._on_context_warning = on_context_warning
        # Whether an adapter is loaded here and may be asked for as ``model`` (serving/adapters.py);
        # None: LoRA is off, and a model name is vLLM's to check.
        self.adapter_served: Callable[[str], bool] | None = None
        self.predictor = OutputPredictor()
        self.lane = ParseLane()
        self.ledger = KvLedger(config.kv_watermark_percent)
        self.queue: MultiLevelQueue = MultiLevelQueue(config.queue_classes, config.aging_seconds,
                                                      config.max_queue_length)
        self.tenants = TenantKeys(self.queue.weigh, self.queue.forget)
        self.retry = RetryAdvisor(config.retry_after_seconds, clock=clock)
        self.scheduler = Scheduler(self.ledger, self.queue, config.max_concurrency,
                                   config.retry_after_seconds, clock=clock, crowd=self.retry.crowd,
                                   arriving=lambda: self.lane.waiting)
        self.configure(config)

    def configure(self, config: GuardConfig) -> None:
        """Put ``config``'s live fields into effect: at start-up, and on a live reload to new
        requests and those waiting in the queue (the running ones keep what they were admitted
        with)."""
        self.config = config
        self.ledger.watermark_percent = config.kv_watermark_percent
        self.ledger.quantile = config.reservation_quantile_percent / 100
        self.queue.reconfigure(config.queue_classes, config.aging_seconds, config.max_queue_length)
        scheduler = self.scheduler
        scheduler.max_concurrency = config.max_concurrency
        scheduler.ttft = ttft_limit_for(config, scheduler.ttft)
        scheduler.retry_after = config.retry_after_seconds
        scheduler.aging_seconds = config.aging_seconds
        self.retry.base = config.retry_after_seconds
        self.retry.maximum = max(self.retry.maximum, config.retry_after_seconds)
        self.update_limits()
        # More slots or a lower watermark may let waiting requests in now.
        scheduler.dispatch()

    # --- what the engine and the tokenizer tell ---------------------------

    @property
    def predicted(self) -> bool:
        return self.config.reservation == "Predicted"

    def update_limits(self) -> None:
        """The context limits from the config and the context vLLM serves (None while unknown)."""
        served, configured = self.served_context, self.config.max_context_tokens
        if served is None:
            self.limits = None
            return
        if configured is not None and configured > served:
            self._on_context_warning(configured, served)
        limit = served if configured is None else min(configured, served)
        self.limits = Limits(limit, self.config.over_length_policy == "TruncateLeft", served,
                             self.default_max_tokens)
        self.max_body_bytes = max_body_bytes(limit)

    def served_context_learned(self, tokens: int) -> None:
        self.served_context = tokens
        self.update_limits()

    def tokenizer_loaded(self, tokenizer: Tokenizer, default_max_tokens: int | None) -> None:
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.update_limits()

    def engine_read(self, snapshot: KvSnapshot, block_size: int | None) -> None:
        """vLLM's KV pool as just read: the ledger follows it, and a request waiting for blocks
        may fit the fresh view."""
        self.ledger.observe(snapshot)
        if block_size:
            self.engine_block_size = block_size
        self.scheduler.dispatch()

    @property
    def block_size(self) -> int:
        return self.engine_block_size or self.config.block_size

    @property
    def known(self) -> bool:
        """Whether requests can be costed: the tokenizer loaded and the context known."""
        return self.tokenizer is not None and self.limits is not None

    # --- a request's way in ----------------------------------------------

    def prepare(self, path: str, body: Any) -> Prepared:
        """Count and check a parsed body for vLLM's route ``path`` (route_costs.py)."""
        assert self.tokenizer is not None and self.limits is not None  # refused until known
        prepared = route_costs.prepare(path, body, self.tokenizer, self.limits)
        if self.adapter_served is not None:
            prepared.adapter = self._adapter(body)
        return prepared

    def _adapter(self, body: dict) -> str | None:
        """The adapter a request asks for; None for the base model; 404 as vLLM answers it for a model
        this replica does not serve now (an adapter not loaded here: the router avoids that)."""
        model = body.get("model")
        if model is None or model == self.config.served_model_name:
            return None
        if isinstance(model, str) and self.adapter_served is not None and self.adapter_served(model):
            return model
        raise Rejection(Reason.INVALID_REQUEST, 404, f"The model `{model}` does not exist. Valid aliases: "
                        f"{self.config.served_model_name}.", param="model")

    def early_refusal(self, queue_class: QueueClass, waited: float = 0.0,
                      tenant: str = UNKNOWN_TENANT) -> Rejection | None:
        return self.scheduler.early_refusal(queue_class, waited, tenant)

    def reserve(self, route: str, queue_class: QueueClass, prepared: Prepared) -> Reservation:
        """Output tokens per sequence to reserve: the learned mean and its variance (Predicted), or
        the budget."""
        key = (route, queue_class.name)
        budget = prepared.max_tokens
        if prepared.phase == kv_handoff.PREFILL:
            # A prefill hands its KV on after sampling: its prompt and the tokens sampled before the
            # last (none in vLLM's P/D protocol, max_tokens 1) are all it holds. No prediction.
            return Reservation(key, prepared, max(0, budget - 1))
        demand = self.predictor.reserve(key, budget) if self.predicted and budget else Demand(budget)
        output = demand.tokens
        if self.predicted and budget and self.ledger.known:
            # Never reserve more than the pool: what does not fit it would be
            # refused while vLLM could still serve it (answers end early).
            while output > 1 and not self.ledger.fits_empty(prepared.block_cost(self.block_size, output)):
                output = max(1, output // 2)
        return Reservation(key, prepared, output, demand.variance)

    def never_fits(self, reservation: Reservation) -> Rejection | None:
        """400 for a request no replica of this size could run, whatever the load."""
        prepared = reservation.prepared
        cost = reservation.cost(self.block_size)
        if self.ledger.fits_empty(cost):
            return None
        bs, total = self.block_size, self.ledger.total_blocks
        sequences = reservation.sequences
        what = (f"{prepared.total_prompt_tokens} prompt tokens and up to {prepared.max_tokens} completion "
                f"tokens per sequence, {sequences} sequence{'s' if sequences > 1 else ''}")
        return Rejection(
            Reason.EXCEEDS_KV_POOL, 400,
            f"This request cannot fit this model's KV cache even when it is empty: it has {what}, "
            f"{cost} blocks of {bs} tokens at least, but a replica holds {self.ledger.capacity} "
            f"({total} blocks, {total * bs} tokens). Send fewer or shorter prompts, fewer sequences (n) "
            f"or a lower max_tokens.")

    async def acquire(self, reservation: Reservation, queue_class: QueueClass,
                      tenant: str = UNKNOWN_TENANT) -> Grant:
        """A slot and the reservation's blocks, now or after a wait in the queue; Rejection else.
        ``tenant``: its key (``tenants.enter``), charged the prompt tokens vLLM computes at dispatch."""
        bs = self.block_size
        grant = await self.scheduler.acquire(reservation.cost(bs), queue_class, reservation.block_variance(bs),
                                             start_tokens=reservation.start_tokens(bs), tenant=tenant,
                                             prompt_tokens=reservation.computed_prompt_tokens(bs))
        self.retry.admitted()
        return grant

    def grant_ahead(self, queue_class: QueueClass, tenant: str = UNKNOWN_TENANT) -> Grant | None:
        """A grant for sending a request on before it is parsed, where the replica is far from
        full: its bound is one sequence of the whole context, the most a single-sequence request
        can hold (a request found to need more, n > 1 or a batch, is settled or admitted anew
        once parsed). None below vLLM's own context: there the guard refuses (or truncates)
        requests vLLM would run, and vLLM would start them. At vLLM's context, vLLM refuses
        what the guard refuses for length, and the copy sent ahead costs it no more than the
        client would."""
        limits = self.limits
        assert limits is not None
        context_tokens = limits.max_context_tokens
        if limits.max_model_len is not None and context_tokens < limits.max_model_len:
            return None
        return self.scheduler.grant_ahead(-(-context_tokens // self.block_size), queue_class, context_tokens,
                                          tenant)

    def settle(self, grant: Grant, reservation: Reservation) -> bool:
        """Keep a grant taken ahead for the request as parsed, if it holds what it needs."""
        bs = self.block_size
        kept = self.scheduler.settle(grant, reservation.cost(bs), reservation.block_variance(bs),
                                     reservation.start_tokens(bs), reservation.computed_prompt_tokens(bs))
        if kept:
            self.retry.admitted()
        return kept

    def release(self, grant: Grant) -> None:
        self.scheduler.release(grant)

    def charge_answer(self, grant: Grant, tokens: int) -> None:
        """``tokens`` more of ``grant``'s answer were counted: charged to its tenant."""
        if tokens > 0:
            self.scheduler.charge_answer(grant, tokens)

    def refused(self, r: Rejection) -> None:
        """A 429 with a retry hint gets one sized to the crowd of clients refused (retry_hint.py)."""
        if r.status == 429 and r.retry_after is not None:
            r.retry_after = self.retry.refused()

    # --- a request's way through ----------------------------------------

    def grow(self, grant: Grant, reservation: Reservation) -> bool:
        """The answer streamed past its reservation: reserve what answers that long went on to use.
        True if the reservation grew."""
        prepared = reservation.prepared
        seen = reservation.events // reservation.sequences
        demand = self.predictor.extension(reservation.key, seen, prepared.max_tokens)
        new_output = demand.tokens
        if new_output <= reservation.output:
            reservation.next_extension = -1
            return False
        old_cost = reservation.cost(self.block_size)
        reservation.output = new_output
        reservation.variance = demand.variance
        self.scheduler.extend(grant, reservation.cost(self.block_size) - old_cost,
                              reservation.block_variance(self.block_size))
        reservation.next_extension = (new_output * reservation.sequences
                                      if new_output < prepared.max_tokens else -1)
        return True

    def learn(self, reservation: Reservation, completion_tokens: int | None) -> Learned | None:
        """A finished answer: its length per sequence joins the distribution."""
        prepared = reservation.prepared
        if completion_tokens is None or prepared.max_tokens == 0 or prepared.phase == kv_handoff.PREFILL:
            return None  # a prefill's one token says nothing of the answers' lengths
        length = per_sequence(reservation, completion_tokens)
        self.predictor.observe(reservation.key, length)
        return Learned(length, length / max(1, reservation.initial_output),
                       self.predictor.prediction(reservation.key))
