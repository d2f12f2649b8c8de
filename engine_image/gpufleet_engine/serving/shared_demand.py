"""The guard's side of ``demand.json`` (``contract/demand_prior.py``): what it has learned, for
the operator to pass on, and what its service learned before it started, to begin from.

A prior that cannot be read never stops a guard: it starts conservative, as
a service's first replica does, and says why in its log.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import cast

from gpufleet_api.guard import demand_prior
from gpufleet_api.guard.demand_prior import DemandPrior, HeldPerRequest, PriorError
from gpufleet_engine.admission.demand import OutputPredictor
from gpufleet_engine.admission.kv_ledger import KvLedger

log = logging.getLogger("gpufleet_engine.serving.shared_demand")


def export(predictor: OutputPredictor, ledger: KvLedger) -> DemandPrior:
    """This guard's learned keys, each as the lengths of its recent answers, and the blocks a
    request in flight holds."""
    keys = []
    for key, lengths in sorted(predictor.export().items(), key=lambda item: str(item[0])):
        route, queue_class = cast(tuple[str, str], key)  # the guard's keys are (route, class)
        keys.append(demand_prior.key_prior(route, queue_class, lengths))
    history = ledger.held_history()
    # Nothing held yet (reads with requests in flight, none streaming) says nothing to pass on.
    return DemandPrior(tuple(keys), HeldPerRequest(*history) if history and history[0] > 0 else None)


def prior_path(config_path: str | Path) -> Path:
    """``demand.json`` beside ``guard.json``: both are keys of the service's guard ConfigMap."""
    return Path(config_path).with_name(demand_prior.FILE_NAME)


def read(path: Path) -> DemandPrior | None:
    """The prior at ``path``; None when there is none (a service's first replica) or it is invalid."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read %s (%s); starting from the full-budget prior", path, e)
        return None
    try:
        return demand_prior.parse(json.loads(text))
    except (json.JSONDecodeError, PriorError) as e:
        log.warning("%s is not a valid output-length prior; starting from the full-budget prior: %s", path, e)
        return None


def seed(predictor: OutputPredictor, ledger: KvLedger, prior: DemandPrior, classes: set[str]) -> list[str]:
    """Seed ``predictor`` with ``prior``'s keys of the queue classes this guard serves, and the
    ledger with its blocks held per request; what was seeded, in words."""
    seeded = []
    for k in prior.keys:
        if k.queue_class in classes and predictor.seed(k.key, k.lengths):
            seeded.append(f"{k.route} ({k.queue_class})")
    if prior.held is not None and ledger.seed_held(prior.held.blocks, prior.held.weight):
        seeded.append(f"{prior.held.blocks:.1f} blocks held per request")
    return seeded
