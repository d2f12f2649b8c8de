"""Leader election on a Lease: the decisions, without I/O.

The rules are client-go's (kube-controller-manager, controller-runtime):

- A candidate may take the Lease when it is free (no holder: released) or
  when the record has not changed for ``leaseDurationSeconds`` *as observed on
  the candidate's own monotonic clock*. Wall-clock timestamps in the record
  (``renewTime``) are written for people, never trusted across machines.
- The holder renews every ``retry_period``. It may act only until
  ``renew_deadline`` after it *sent* its last successful renewal. The write
  landed after it was sent, and a candidate observed it later still, so the
  holder stops at least ``lease_duration - renew_deadline`` (5 s by default)
  before any candidate may take over: never two leaders at once.
- Every write carries the resourceVersion it was computed from; a conflict
  means someone else wrote first, and this replica is not the leader.

``Leadership`` is the state machine; ``kube.lease`` reads and writes the
Lease, and ``elector`` runs the loop, times the requests and reports.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from ..errors import OperatorError

JITTER = 1.2  # client-go: candidates retry every retry_period * [1, 1.2)


class TimingError(OperatorError, ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Timing:
    """The usual defaults of Kubernetes controllers: 15 s / 10 s / 2 s."""
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline:
            raise TimingError(f"the lease duration ({self.lease_duration:g}s) must be longer than the renew "
                              f"deadline ({self.renew_deadline:g}s): the difference is the margin between the "
                              f"leader stopping and another starting")
        if not self.renew_deadline > JITTER * self.retry_period:
            raise TimingError(f"the renew deadline ({self.renew_deadline:g}s) must be longer than "
                              f"{JITTER:g} x the retry period ({self.retry_period:g}s)")
        if self.retry_period <= 0:
            raise TimingError("the retry period must be positive")


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """The fields of a coordination.k8s.io/v1 Lease that election uses."""
    holder: str | None
    lease_duration_seconds: int
    transitions: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    resource_version: str | None = None

    def version(self) -> tuple:
        """What changes on every write: a candidate's clock restarts when it does."""
        return (self.holder, self.renew_time, self.resource_version)


@dataclasses.dataclass(frozen=True)
class Write:
    """The Lease to write: ``create`` when there is none yet, else an update guarded by
    ``resource_version``. ``acquiring``: taking it over (not renewing our own)."""
    record: LeaseRecord
    create: bool
    acquiring: bool


Change = Literal["acquired", "lost", "released"]


class Leadership:
    """One replica's view of one Lease. Times are ``time.monotonic()`` seconds."""

    def __init__(self, identity: str, timing: Timing = Timing()):
        self.identity = identity
        self.timing = timing
        self.leading = False
        self.renewed_at: float | None = None   # when the last successful write of ours was sent
        self.record: LeaseRecord | None = None  # the last record read or written
        self._observed: tuple | None = None
        self._observed_at = 0.0
        self._observed_duration = timing.lease_duration

    # --- observing ---------------------------------------------------------------

    def observe(self, record: LeaseRecord | None, now: float) -> None:
        self.record = record
        if record is None:
            self._observed = None
            return
        if record.version() != self._observed:
            self._observed, self._observed_at = record.version(), now
            self._observed_duration = float(record.lease_duration_seconds or self.timing.lease_duration)

    @property
    def holder(self) -> str | None:
        """Who the last observed record names; None when the Lease is free."""
        return (self.record.holder or None) if self.record is not None else None

    def expires_at(self) -> float | None:
        """When another holder's lease runs out on our clock; None when there is no other holder."""
        if self.holder is None or self.holder == self.identity:
            return None
        return self._observed_at + self._observed_duration

    # --- deciding ----------------------------------------------------------------

    def next_write(self, record: LeaseRecord | None, now: float, wall_now: str) -> Write | None:
        """What to write after reading ``record`` at ``now``; None: someone else holds a valid lease."""
        self.observe(record, now)
        seconds = round(self.timing.lease_duration)
        if record is None:
            return Write(LeaseRecord(self.identity, seconds, 0, wall_now, wall_now), create=True, acquiring=True)
        expiry = self.expires_at()
        if expiry is not None and now < expiry:
            return None
        if record.holder == self.identity:
            return Write(dataclasses.replace(record, lease_duration_seconds=seconds, renew_time=wall_now),
                         create=False, acquiring=not self.leading)
        return Write(LeaseRecord(self.identity, seconds, record.transitions + 1, wall_now, wall_now,
                                 record.resource_version), create=False, acquiring=True)

    def written(self, write: Write, stored: LeaseRecord, sent_at: float) -> Change | None:
        """Our write was stored; ``sent_at``: when it was sent (the deadline counts from there)."""
        self.observe(stored, sent_at)
        self.renewed_at = sent_at
        if not self.leading:
            self.leading = True
            return "acquired"
        return None

    def write_failed(self, now: float) -> Change | None:
        """A read or write failed or lost a race: leadership ends only at its deadline."""
        return self.check(now)

    def check(self, now: float) -> Change | None:
        """Step down when the renew deadline has passed, or another holder is seen."""
        if self.leading and (self._taken() or not self.may_act(now)):
            self.leading = False
            return "lost"
        return None

    def release(self, wall_now: str) -> LeaseRecord | None:
        """Stop acting now; the record that hands the Lease over at once (client-go's: no
        holder, a 1 s duration), or None when the last record seen is not ours."""
        self.leading = False
        self.renewed_at = None
        if self.record is None or self.record.holder != self.identity:
            return None
        return dataclasses.replace(self.record, holder=None, lease_duration_seconds=1, renew_time=wall_now)

    # --- acting ------------------------------------------------------------------

    def acting_for(self, now: float) -> float:
        """Seconds this replica may still act (write) for; 0 when it is not the leader."""
        if not self.leading or self.renewed_at is None or self._taken():
            return 0.0
        return max(0.0, self.renewed_at + self.timing.renew_deadline - now)

    def _taken(self) -> bool:
        return self.record is not None and self.record.holder not in (None, self.identity)

    def may_act(self, now: float) -> bool:
        return self.acting_for(now) > 0

    def next_attempt_in(self, now: float, jitter: float) -> float:
        """Seconds to the next read: every retry period, sooner when another's lease runs out.
        ``jitter`` in [0, 1) spreads candidates (client-go's JitterUntil)."""
        if self.leading:
            return self.timing.retry_period
        wait = self.timing.retry_period * (1 + (JITTER - 1) * jitter)
        expiry = self.expires_at()
        if expiry is not None and expiry > now:
            wait = min(wait, expiry - now)
        return max(0.0, wait)
