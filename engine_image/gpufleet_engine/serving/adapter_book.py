"""The adapter agent's book: which adapters this replica should hold, what became of each, and
what to do next. Pure: no files, no sockets, no clock of its own; ``serving/adapters.py``
does what ``next_steps`` says and reports back.

An adapter in the desired set goes Fetching → Loading → Loaded; one that fails is Failed with
a reason (contract/adapters.py FAILURE_REASONS) and stays so until the set changes it, except
SourceUnreachable, which is fetched again after a backoff. One that leaves the set is
Unloading until vLLM has let it go and no request of this replica uses it, then forgotten.
What vLLM holds is read back (``engine_holds``): an adapter vLLM lost (it restarted) is
loaded again, and one vLLM holds that the book does not want is unloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from gpufleet_api.guard.adapters import (
    AdapterReport,
    AdapterSet,
    AdapterSource,
    AdapterSpec,
    AdapterState,
    AdapterStateName,
    spec_digest,
)
from gpufleet_kit.backoff import delay

RETRIED_REASON = "SourceUnreachable"
BACKOFF_FIRST_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 300.0

StepKind = Literal["fetch", "load", "unload", "forget"]
# An adapter vLLM holds that no set of this guard named (it restarted while vLLM did not).
_NO_SOURCE = AdapterSource()


@dataclass
class Entry:
    spec: AdapterSpec
    state: AdapterStateName
    since: float
    reason: str | None = None
    message: str = ""
    rank: int | None = None
    path: Path | None = None     # the checked folder vLLM loads; None: to fetch
    in_engine: bool = False      # vLLM holds an adapter under this name
    wanted: bool = True          # in the desired set; False: unload, then forget
    attempts: int = 0            # SourceUnreachable failures in a row
    retry_at: float = 0.0


@dataclass(frozen=True)
class Step:
    kind: StepKind
    name: str
    spec: AdapterSpec
    path: Path | None = None     # load: the folder to hand vLLM


def backoff(attempts: int) -> float:
    """Seconds before fetching again after ``attempts`` SourceUnreachable failures in a row."""
    return delay(max(1, attempts), BACKOFF_FIRST_SECONDS, BACKOFF_MAX_SECONDS)


class AdapterBook:
    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    # --- what is wanted ----------------------------------------------------

    def desire(self, adapters: AdapterSet, now: float) -> None:
        """The whole set this replica should hold from now on (declarative: the same set twice
        changes nothing; an adapter whose source changed is fetched and loaded anew)."""
        wanted = {a.name: a for a in adapters.adapters}
        for name, entry in self.entries.items():
            if name not in wanted and entry.wanted:
                entry.wanted = False
                self._set(entry, "Unloading", now)
        for name, spec in wanted.items():
            known = self.entries.get(name)
            if known is None:
                self.entries[name] = Entry(spec, "Fetching", now)
            elif not known.wanted or known.spec != spec:
                self.entries[name] = Entry(spec, "Fetching", now, in_engine=known.in_engine)

    # --- what vLLM holds -----------------------------------------------------

    def engine_holds(self, names: set[str], now: float) -> list[str]:
        """vLLM's adapters as just read. Returns the adapters it lost that were Loaded (it restarted)."""
        lost = []
        for name, entry in self.entries.items():
            if entry.in_engine and name not in names:
                entry.in_engine = False
                if entry.state == "Loaded":
                    lost.append(name)
                    self._set(entry, "Loading", now)
        for name in names - self.entries.keys():
            # Not ours (the guard restarted, vLLM did not): vLLM's adapters are the book's to decide.
            self.entries[name] = Entry(AdapterSpec(name, _NO_SOURCE), "Unloading", now, in_engine=True,
                                       wanted=False)
        for name in names & self.entries.keys():
            self.entries[name].in_engine = True
        return lost

    # --- what to do next -----------------------------------------------------

    def next_steps(self, now: float, busy: Callable[[str], int], engine_up: bool) -> list[Step]:
        """What to do now, in order. vLLM is asked only while ``engine_up``; an adapter leaves vLLM
        only when no request uses it (``busy``)."""
        steps = []
        for name, entry in self.entries.items():
            if not entry.wanted:
                if not entry.in_engine:
                    steps.append(Step("forget", name, entry.spec))
                elif engine_up and not busy(name):
                    steps.append(Step("unload", name, entry.spec))
            elif entry.path is None:
                if entry.in_engine:
                    # Its source changed while vLLM holds the old one under its name.
                    if engine_up and not busy(name):
                        steps.append(Step("unload", name, entry.spec))
                elif entry.state == "Fetching" or (entry.state == "Failed" and entry.reason == RETRIED_REASON
                                                   and entry.retry_at <= now):
                    steps.append(Step("fetch", name, entry.spec))
            elif entry.state == "Loading" and engine_up and not entry.in_engine:
                steps.append(Step("load", name, entry.spec, entry.path))
        return steps

    def next_retry(self) -> float | None:
        """When the earliest SourceUnreachable adapter is due again; None if none is."""
        due = [e.retry_at for e in self.entries.values()
               if e.wanted and e.state == "Failed" and e.reason == RETRIED_REASON]
        return min(due, default=None)

    # --- what happened -------------------------------------------------------

    def fetched(self, name: str, spec: AdapterSpec, path: Path, rank: int, now: float) -> None:
        entry = self._current(name, spec)
        if entry is None:
            return
        entry.path, entry.rank, entry.attempts = path, rank, 0
        entry.reason, entry.message = None, ""
        self._set(entry, "Loading", now)

    def failed(self, name: str, spec: AdapterSpec, reason: str, message: str, now: float) -> bool:
        """The adapter cannot be served as it is; False when it left the set (or changed) meanwhile."""
        entry = self._current(name, spec)
        if entry is None:
            return False
        entry.reason, entry.message, entry.path = reason, message, None
        if reason == RETRIED_REASON:
            entry.attempts += 1
            entry.retry_at = now + backoff(entry.attempts)
        self._set(entry, "Failed", now)
        return True

    def loaded(self, name: str, spec: AdapterSpec, now: float) -> None:
        entry = self.entries.get(name)
        if entry is None:
            return
        entry.in_engine = True
        if entry.wanted and entry.spec == spec:
            self._set(entry, "Loaded", now)

    def unloaded(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.in_engine = False

    def forgotten(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is not None and not entry.wanted and not entry.in_engine:
            del self.entries[name]

    # --- what is asked -------------------------------------------------------

    def serves(self, name: str) -> bool:
        """Whether requests for ``name`` go to vLLM now."""
        entry = self.entries.get(name)
        return entry is not None and entry.wanted and entry.state == "Loaded" and entry.in_engine

    def names(self) -> set[str]:
        """Every adapter in the book: at most the set's cap plus those still leaving."""
        return set(self.entries)

    def report(self, max_adapters: int, max_loras: int, max_cpu_loras: int) -> AdapterReport:
        return AdapterReport(
            tuple(AdapterState(name, e.state, e.reason, e.message, e.rank, e.since,  # type: ignore[arg-type]
                               spec_digest(e.spec))
                  for name, e in sorted(self.entries.items())),
            max_adapters, max_loras, max_cpu_loras)

    def _current(self, name: str, spec: AdapterSpec) -> Entry | None:
        entry = self.entries.get(name)
        return entry if entry is not None and entry.wanted and entry.spec == spec else None

    @staticmethod
    def _set(entry: Entry, state: AdapterStateName, now: float) -> None:
        if entry.state != state:
            entry.state, entry.since = state, now

