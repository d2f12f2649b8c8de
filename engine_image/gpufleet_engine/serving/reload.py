"""guard.json changes reach a running guard without restarting it or vLLM.

The kubelet updates a mounted ConfigMap in place (within its sync period,
about a minute) by swapping a symlink; the guard polls the file's content
every few seconds. Of a new version it applies the ``live`` fields (marked
``LIVE`` in the contract: admission, queue, limit and SLO
settings) at once, to new requests and to those waiting in its queue; the
requests already running keep what they were admitted with. The other fields
(vLLM's ``engine`` section, addresses, model and tokenizer) need the pod
restarted: the operator hashes only those into the pod template, so a change
to them rolls the pods, and until the new pod runs this guard keeps its own.

A new version that does not parse, or whose live fields do not fit the
engine this guard runs with, is refused: the guard keeps the settings it has,
logs every problem and counts ``result="invalid"``
(``gpufleet_guard_config_reloads_total``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gpufleet_api.guard import guard_config
from gpufleet_api.guard.guard_config import ConfigError, GuardConfig

if TYPE_CHECKING:
    from gpufleet_engine.serving.prometheus import GuardMetrics

log = logging.getLogger("gpufleet_engine.serving.reload")

POLL_SECONDS = 2.0
APPLIED, INVALID = "applied", "invalid"
RESULTS = (APPLIED, INVALID)


@dataclasses.dataclass(frozen=True)
class Outcome:
    result: str                     # APPLIED or INVALID
    changed: tuple[str, ...] = ()   # live keys now in effect
    pending: tuple[str, ...] = ()   # restart keys that differ from what runs (take effect with a new pod)
    problems: tuple[str, ...] = ()  # why an INVALID version was refused


class ConfigWatcher:
    """Re-reads guard.json when its content changes and hands valid live changes to ``on_apply``."""

    def __init__(self, path: str | Path, running: GuardConfig, on_apply: Callable[[GuardConfig], None],
                 metrics: "GuardMetrics", poll_seconds: float = POLL_SECONDS):
        self.path = Path(path)
        self.started_with = running   # the restart fields never change in this process
        self.running = running
        self._on_apply = on_apply
        self._metrics = metrics
        self.poll_seconds = poll_seconds
        self._seen = self._digest()

    def _read(self) -> str | None:
        try:
            return self.path.read_text()
        except OSError:
            return None  # mid-swap or unmounted: try again at the next poll

    def _digest(self, text: str | None = None) -> str | None:
        text = self._read() if text is None else text
        return None if text is None else hashlib.sha256(text.encode()).hexdigest()[:16]

    def check(self) -> Outcome | None:
        """One poll: None when the file is unchanged (or unreadable), else what became of the new version."""
        text = self._read()
        digest = self._digest(text) if text is not None else None
        if digest is None or digest == self._seen:
            return None
        self._seen = digest
        assert text is not None
        try:
            new = guard_config.parse(json.loads(text))
            merged = guard_config.with_live_fields(self.running, new)
        except json.JSONDecodeError as e:
            return self._refuse(digest, [f"{self.path}: not valid JSON ({e})"])
        except ConfigError as e:
            return self._refuse(digest, e.problems)
        changed = tuple(guard_config.live_changes(self.running, merged))
        pending = tuple(guard_config.restart_changes(self.started_with, new))
        if changed:
            self._on_apply(merged)
            self.running = merged
            log.info("guard.json reloaded (%s): applied %s", digest, ", ".join(changed))
        if pending:
            log.info("guard.json (%s) changes %s, which take effect when the pod restarts",
                     digest, ", ".join(pending))
        self._metrics.config_reloads.labels(APPLIED).inc()
        self._metrics.config_restart_pending.set(1 if pending else 0)
        return Outcome(APPLIED, changed, pending)

    def _refuse(self, digest: str, problems: list[str]) -> Outcome:
        log.error("guard.json (%s) refused, keeping the running settings:\n  - %s", digest, "\n  - ".join(problems))
        self._metrics.config_reloads.labels(INVALID).inc()
        return Outcome(INVALID, problems=tuple(problems))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            self.check()
