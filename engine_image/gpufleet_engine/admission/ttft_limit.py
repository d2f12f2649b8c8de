"""How many requests may run in vLLM at once so that time to first token keeps its objective.

Pure: no clock, no I/O; the guard feeds it observations and asks it questions.

vLLM answers a new request's first token after the prefills ahead of it and
while every running sequence decodes in the same steps: the more requests
run, the longer each step, the later the first token. The KV watermark keeps
the pool from running dry, but a pool that holds many short answers admits
far more concurrent requests than the engine can start promptly. Past that
point admitting more buys little throughput and costs every newcomer its TTFT.

So the guard keeps a concurrency limit under ``max_concurrency`` and adapts
it to what it sees, like TCP's congestion window (additive increase,
multiplicative decrease; Netflix's concurrency-limits do the same for RPC):

- a sample is one streamed request's engine time to first token: from its
  dispatch to vLLM to its first chunk, without the time it waited in the
  guard;
- every ``window`` samples, the window's 90th percentile is compared with
  the engine's share of the objective (``ENGINE_SHARE`` x slo.ttftP99Seconds):
  over it, the limit drops to the requests that were running times
  ``DECREASE``, or times target / p90 when the first tokens came later than
  that (at least ``DEEPEST_CUT``, and at least ``floor``), so a limit far above
  what the engine starts in time converges in a few windows; under half of it
  while the limit was reached, the limit grows by a quarter (at least one), so
  a limit cut during a burst recovers within a few windows;
- a request whose own prefill takes half the objective says nothing about
  contention and is left out, so a fleet serving long prompts is not
  throttled for their length. Its own prefill is estimated from the best
  prefill rate seen (prompt tokens per second of engine TTFT, over every
  sample): an upper bound, since no sample is faster than the engine alone.

The limit acts only while the replica is overloaded (``Scheduler.overloaded``:
more asked of it than its KV pool holds at once, where vLLM alone would
preempt); below that the guard admits what vLLM alone would serve, as fast
as it would. The control keeps learning meanwhile, from what ran unheld
(``observe(acting=False)``), so that the limit is right from the first
moment of an overload instead of descending from the ceiling through the
overload's first hundreds of requests.

Requests over the limit wait in the guard's queue, but only as long as the
objective leaves (``QUEUE_SHARE`` of it): ``wait_budget`` bounds the wait the
scheduler predicts from the queue ahead and the pace at which slots free.
Requests that would wait longer get 429 with the predicted wait as the retry
hint. A service with the control Off keeps ``max_concurrency`` as its only
limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpufleet_api.guard.guard_config import GuardConfig
from gpufleet_kit.stats import nearest_rank

ENGINE_SHARE = 0.6    # of the TTFT objective, for the engine's time to first token (window p90)
QUEUE_SHARE = 0.3     # of the TTFT objective, for the wait in the guard's queue
DECREASE = 0.8        # the limit after a window over the engine's share, times the requests running,
DEEPEST_CUT = 0.5     # ...or less in proportion to how late first tokens came, down to this share
QUANTILE = 0.9        # of each window's samples
WINDOW = 16           # samples per decision
PACE_WEIGHT = 0.1     # of the newest interval in the moving mean of intervals between freed slots
GROWTH = 0.25         # of the limit, added after a fast window in which the limit was reached
START_RATE_WEIGHT = 0.2   # of the newest sample in the moving mean of the rate bursts started at
START_SAMPLE_SHARE = 0.25  # of the start budget, starting at once, for a first token to say how fast bursts start
# Time, not only samples: a control that refuses nearly everything gets almost no first tokens to
# learn from, so what it learned in an overload must fade by itself once the overload is over.
STALE_SECONDS = 5.0        # a window's samples older than this say nothing about now: dropped
RECOVERY_HALF_LIFE_SECONDS = 5.0  # a cut limit's gap to the ceiling halves this often, from
#                            STALE_SECONDS after the last window over the target


@dataclass
class TtftLimit:
    objective_seconds: float   # slo.ttftP99Seconds
    ceiling: int               # max_concurrency
    floor: int = 1
    window: int = WINDOW
    limit: int = 0             # 0: start at the ceiling
    decreases: int = 0
    increases: int = 0
    _samples: list[tuple[float, int, float]] = field(default_factory=list)  # (engine TTFT, running, at)
    _best_rate: float = 0.0     # prompt tokens per second of engine TTFT, the most seen
    _start_rate: float = 0.0    # prompt tokens per second at which bursts got first tokens (moving mean)
    _last_release: float | None = None
    _pace: float | None = None  # moving mean of seconds between freed slots
    _cut_at: float | None = None   # when a window last came over the target (``now`` given)
    _cut_limit: int = 0            # the limit that window set

    def __post_init__(self) -> None:
        if self.objective_seconds <= 0:
            raise ValueError(f"objective_seconds must be positive, got {self.objective_seconds}")
        self.ceiling = max(1, self.ceiling)
        self.floor = max(1, min(self.floor, self.ceiling))
        self.limit = self.ceiling if self.limit <= 0 else max(self.floor, min(self.limit, self.ceiling))

    @property
    def engine_target(self) -> float:
        return ENGINE_SHARE * self.objective_seconds

    @property
    def start_rate(self) -> float:
        """Prompt tokens per second at which requests starting together get their first tokens:
        learned from bursts (``started``), else the best rate seen; 0 before any first token."""
        return min(self._start_rate, self._best_rate) if self._start_rate else self._best_rate

    @property
    def start_budget(self) -> float:
        """Prompt tokens that may be starting at once (dispatched, first token not back) while the
        control acts: what starts in the engine's share of the objective at ``start_rate``;
        unbounded until a first token was seen."""
        return self.start_rate * self.engine_target if self._best_rate else math.inf

    @property
    def loose_start_budget(self) -> float:
        """The same bound below overload, at the best rate seen (one prompt alone): it stops a
        burst from prefilling far past the objective, and holds back little else, so the guard
        starts requests about as vLLM alone would. (At the learned burst rate it queued enough at
        the highest load vLLM serves without preempting to triple the TTFT p99 there.)"""
        return self._best_rate * self.engine_target if self._best_rate else math.inf

    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Seconds until ``prompt_tokens`` starting now get their first tokens, at ``start_rate``
        (0 until a first token was seen): how long they keep a newcomer from starting."""
        return prompt_tokens / self.start_rate if self._best_rate else 0.0

    def started(self, engine_ttft: float, start_set_tokens: int) -> None:
        """A first token ``engine_ttft`` seconds after dispatch, for a request that started with
        ``start_set_tokens`` prompt tokens starting (itself included). The best rate is one
        prompt alone; a burst's prompts start slower together (each adds its own overhead, and
        the relay of every first token waits its turn), so the start budget learns from the
        bursts that filled a good part of it."""
        if not self._best_rate or start_set_tokens < START_SAMPLE_SHARE * self.start_budget:
            return
        rate = start_set_tokens / max(engine_ttft, 1e-6)
        self._start_rate = rate if not self._start_rate else (
            (1 - START_RATE_WEIGHT) * self._start_rate + START_RATE_WEIGHT * rate)

    @property
    def wait_budget(self) -> float:
        """Seconds a request may wait in the guard for a slot under this limit."""
        return QUEUE_SHARE * self.objective_seconds

    def retune(self, objective_seconds: float, ceiling: int) -> None:
        """A new objective or max_concurrency (guard.json reloaded): keep what was learned."""
        unheld = self.limit >= self.ceiling  # the control was not holding the limit down
        self.objective_seconds = objective_seconds
        self.ceiling = max(1, ceiling)
        self.floor = min(self.floor, self.ceiling)
        self.limit = self.ceiling if unheld else max(self.floor, min(self.limit, self.ceiling))
        self._samples.clear()

    def recover(self, now: float) -> None:
        """Let time undo a cut: from ``STALE_SECONDS`` after the last window over the target, the
        limit's gap to the ceiling halves every ``RECOVERY_HALF_LIFE_SECONDS``, and the window's
        samples older than ``STALE_SECONDS`` are dropped. Under a lasting overload windows keep
        coming over the target sooner than that, so the limit stays where they put it."""
        if self._samples and now - self._samples[0][2] > STALE_SECONDS:
            self._samples = [s for s in self._samples if now - s[2] <= STALE_SECONDS]
        if self._cut_at is None or self.limit >= self.ceiling:
            return
        quiet = now - self._cut_at - STALE_SECONDS
        if quiet <= 0:
            return
        gap = (self.ceiling - self._cut_limit) * 0.5 ** (quiet / RECOVERY_HALF_LIFE_SECONDS)
        self.limit = max(self.limit, min(self.ceiling, math.ceil(self.ceiling - gap - 1e-9)))
        if self.limit >= self.ceiling:
            self._cut_at = None

    def observe(self, engine_ttft: float, prompt_tokens: int, running: int, acting: bool = True,
                now: float | None = None) -> None:
        """One streamed request's first token, ``engine_ttft`` seconds after its dispatch, with
        ``running`` requests in vLLM when it was dispatched (itself included).
        ``acting``: whether the limit held the requests back (else it only learns: a window
        over the target sets it to the share of what ran, one within the target raises it to
        what ran, so that it is ready when the replica is overloaded). ``now``: the clock, for
        ``recover``; without it the control learns from samples alone."""
        if now is not None:
            self.recover(now)
        tokens = max(1, prompt_tokens)
        self._best_rate = max(self._best_rate, tokens / max(engine_ttft, 1e-6))
        if tokens / self._best_rate >= self.objective_seconds / 2:
            return  # its own prefill is most of the objective; contention is not what it measures
        self._samples.append((engine_ttft, max(1, running), now if now is not None else 0.0))
        if len(self._samples) < self.window:
            return
        high = nearest_rank([s[0] for s in self._samples], QUANTILE)
        mean_running = sum(s[1] for s in self._samples) / len(self._samples)
        self._samples.clear()
        if high > self.engine_target:
            # First tokens come later the more requests run: cut in proportion to how late they
            # came (at least to DECREASE, at most to DEEPEST_CUT of what ran in one window).
            cut = max(DEEPEST_CUT, min(DECREASE, self.engine_target / high))
            ran = min(self.limit, mean_running) if acting else mean_running
            new = max(self.floor, min(self.ceiling, math.floor(cut * ran + 1e-9)))
            if new < self.limit and acting:
                self.decreases += 1
            if new < self.limit or not acting:
                self.limit = new
            if now is not None and self.limit < self.ceiling:
                self._cut_at, self._cut_limit = now, self.limit
            return
        if not acting:
            # This many ran, the limit not holding them, and started in time: allow as many.
            self.limit = max(self.limit, min(self.ceiling, math.floor(mean_running)))
        if high < self.engine_target / 2 and mean_running >= self.limit - 1 and self.limit < self.ceiling:
            self.limit = min(self.ceiling, self.limit + max(1, math.floor(GROWTH * self.limit)))
            self.increases += 1

    def released(self, now: float, busy: bool) -> None:
        """A slot was freed at ``now``; ``busy``: every slot was taken until then. The pace at which
        queued requests can be dispatched is learned from busy stretches only: an idle minute is no
        measure of how soon a slot frees under load."""
        if not busy:
            self._last_release = None
            return
        if self._last_release is not None:
            interval = max(0.0, now - self._last_release)
            self._pace = interval if self._pace is None else (
                (1 - PACE_WEIGHT) * self._pace + PACE_WEIGHT * interval)
        self._last_release = now

    def predicted_wait(self, ahead: int) -> float:
        """Seconds until a slot frees for a request with ``ahead`` requests queued before it."""
        if self._pace is None:
            return 0.0 if ahead == 0 else math.inf
        return (ahead + 1) * self._pace


def ttft_limit_for(config: GuardConfig, running: TtftLimit | None = None) -> TtftLimit | None:
    """The TTFT control ``config`` asks for; ``running``: the one in effect, whose learning a
    reload keeps."""
    if config.ttft_control == "Off":
        return None
    if running is None:
        return TtftLimit(config.slo.ttft_p99_seconds, config.max_concurrency)
    running.retune(config.slo.ttft_p99_seconds, config.max_concurrency)
    return running
