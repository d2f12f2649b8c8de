"""demand.json (contract/demand_prior.py): the output lengths one replica learned, summarised,
pooled across replicas and seeded into a new replica's predictor."""
from __future__ import annotations

import random

import pytest

from gpufleet_api.guard import demand_prior
from gpufleet_api.guard.demand_prior import DemandPrior, KeyPrior, PriorError
from gpufleet_engine.admission.demand import MIN_SAMPLES, OutputPredictor

KEY = ("/v1/chat/completions", "interactive")


def answers(seed: int = 1, n: int = 512) -> list[int]:
    """Real answers' lengths: skewed, most short, a long tail."""
    rng = random.Random(seed)
    return sorted(min(1024, max(1, int(rng.lognormvariate(3.7, 0.8)))) for _ in range(n))


def predictor_with(lengths: list[int]) -> OutputPredictor:
    p = OutputPredictor()
    for n in lengths:
        p.observe(KEY, n)
    return p


def test_a_seeded_replica_reserves_what_the_replica_it_learned_from_reserves():
    warm = predictor_with(answers())
    prior = DemandPrior((demand_prior.key_prior(*KEY, warm.export()[KEY]),))
    new = OutputPredictor()
    assert new.reserve(KEY, 1900).tokens == 1900          # unseeded: the whole budget
    assert new.seed(KEY, prior.keys[0].lengths)
    assert new.learned(KEY)
    for budget in (1900, 200, 64):                        # with the budget clipping the tail too
        want, got = warm.reserve(KEY, budget), new.reserve(KEY, budget)
        assert abs(got.tokens - want.tokens) <= max(2, 0.05 * want.tokens), budget
        assert got.variance == pytest.approx(want.variance, rel=0.15), budget


def test_a_replica_keeps_what_it_learned_itself():
    own = predictor_with([7] * MIN_SAMPLES)
    assert not own.seed(KEY, (500,) * 64)
    assert own.reserve(KEY, 1000).tokens == 7


def test_a_few_answers_of_its_own_are_kept_beside_the_seed():
    p = predictor_with([7, 7, 7])
    assert p.seed(KEY, (100,) * 64)
    assert p.samples(KEY) == 67


def test_replicas_pool_weighted_by_the_answers_behind_them():
    busy = KeyPrior(*KEY, 5000, (100,) * 500)    # 5000 answers behind its 500 points
    quiet = demand_prior.key_prior(*KEY, [10] * 100)
    pooled = demand_prior.merge([DemandPrior((busy,)), DemandPrior((quiet,))])
    (k,) = pooled.keys
    assert k.samples == 5100 and len(k.lengths) == demand_prior.POINTS
    assert 9 <= sum(1 for n in k.lengths if n == 10) <= 11   # 2% of the answers were short: 2% of the points


def test_pooling_one_replica_gives_back_its_own_quantiles():
    lengths = answers(3)
    one = demand_prior.key_prior(*KEY, lengths)
    (k,) = demand_prior.merge([DemandPrior((one,))]).keys
    assert k.lengths == one.lengths


def test_only_a_new_key_or_a_moved_mean_is_worth_a_write():
    base = DemandPrior((KeyPrior(*KEY, 100, (50,) * 64),))
    assert demand_prior.differs(base, None)
    assert not demand_prior.differs(DemandPrior(), None)
    assert not demand_prior.differs(DemandPrior((KeyPrior(*KEY, 300, (53,) * 64),)), base)
    assert demand_prior.differs(DemandPrior((KeyPrior(*KEY, 300, (56,) * 64),)), base)
    other = KeyPrior("/v1/completions", "standard", 20, (9,) * 64)
    assert demand_prior.differs(DemandPrior((base.keys[0], other)), base)


def test_the_document_round_trips():
    prior = DemandPrior((demand_prior.key_prior(*KEY, answers()),))
    assert demand_prior.parse(demand_prior.to_document(prior)) == prior


def test_every_wrong_field_is_named():
    with pytest.raises(PriorError) as e:
        demand_prior.parse({"version": 2, "keys": [
            {"route": "", "class": "interactive", "samples": 0, "lengths": [1, -2]},
            "nope"]})
    text = "\n".join(e.value.problems)
    for field in ("version", "keys[0].route", "keys[0].samples", "keys[0].lengths", "keys[1]"):
        assert field in text
    with pytest.raises(PriorError, match="keys: must be a list"):
        demand_prior.parse({"version": 1})


def test_the_blocks_a_request_holds_pool_by_the_reads_behind_them_and_seed_a_new_ledger():
    from gpufleet_api.guard.demand_prior import HeldPerRequest
    from gpufleet_engine.admission.kv_ledger import KvLedger, KvSnapshot

    pooled = demand_prior.merge([DemandPrior((), HeldPerRequest(4.0, 300.0)),
                                 DemandPrior((), HeldPerRequest(8.0, 100.0)), DemandPrior()])
    assert pooled.held == HeldPerRequest(5.0, 200.0)
    assert demand_prior.parse(demand_prior.to_document(pooled)) == pooled
    assert demand_prior.differs(pooled, None)
    assert not demand_prior.differs(DemandPrior((), HeldPerRequest(5.4, 9.0)), pooled)
    assert demand_prior.differs(DemandPrior((), HeldPerRequest(5.5, 9.0)), pooled)

    ledger = KvLedger(5)
    assert ledger.held_per_request is None                # a new replica: nothing read yet
    assert ledger.seed_held(5.0, 200.0) and ledger.held_per_request == 5.0
    ledger.observe(KvSnapshot(512, 0))                    # an idle read: nothing in flight to weigh
    assert ledger.try_admit("r", 3).admitted
    ledger.observe(KvSnapshot(512, 60))                   # its own first read: 1 request holding 60
    assert 5.0 < ledger.held_per_request < 6.0            # moves it by the weight of one request's read
    assert not ledger.seed_held(1.0, 1000.0)              # its own reads are not overwritten


def test_a_held_figure_that_is_not_a_positive_number_is_named():
    with pytest.raises(PriorError, match=r"heldPerRequest\.weight"):
        demand_prior.parse({"version": 1, "keys": [], "heldPerRequest": {"blocks": 4, "weight": 0}})
