"""The pure adapter logic: the index by service, request rates, each replica's set, and status."""
import msgspec

from gpufleet.adapters import desired
from gpufleet.adapters import status as st
from gpufleet.adapters.index import AdapterIndex
from gpufleet.adapters.rates import AdapterRates
from gpufleet_api import parse_spec
from gpufleet_api.guard.adapters import (
    AdapterReport,
    AdapterSet,
    AdapterSource,
    AdapterSpec,
    AdapterState,
    spec_digest,
)


def body(name, service="chat", generation=1, ns="ml", **spec):
    return {"apiVersion": "serving.gpufleet.dev/v1alpha1", "kind": "InferenceAdapter",
            "metadata": {"name": name, "namespace": ns, "generation": generation},
            "spec": {"service": service, "source": {"uri": f"https://store/{name}.tar"}, **spec}}


def lora(**fields):
    return parse_spec({"model": {"name": "m"}, "engine": {"lora": fields}}).engine.lora


def report(*states, max_adapters=4):
    return AdapterReport(adapters=tuple(AdapterState(name=n, state=s, **extra) for n, s, *rest in states
                                        for extra in [rest[0] if rest else {}]), max_adapters=max_adapters)


# --- index ---------------------------------------------------------------------------------------

def test_index_keeps_adapters_by_service_and_follows_a_move():
    idx = AdapterIndex()
    idx.upsert(body("a"))
    idx.upsert(body("b"))
    idx.upsert(body("c", service="other"))
    assert [a.name for a in idx.of("ml", "chat")] == ["a", "b"]
    idx.upsert(body("b", service="other", generation=2))
    assert [a.name for a in idx.of("ml", "chat")] == ["a"]
    assert [a.name for a in idx.of("ml", "other")] == ["b", "c"]
    idx.remove("ml", "a")
    assert idx.services() == [("ml", "other")]


def test_index_keeps_an_adapter_the_types_refuse_without_a_spec():
    idx = AdapterIndex()
    a = idx.upsert(body("bad", source={}, placement={"minReplicas": "two"}))
    assert a.spec is None and a.service == "chat"


# --- rates ---------------------------------------------------------------------------------------

def test_rates_sum_replicas_over_the_window_and_survive_a_guard_restart():
    r = AdapterRates(window=60)
    r.observe("p1", {"a": 100}, 0)
    r.observe("p2", [("a", 10), ("b", 0)], 0)
    r.observe("p1", {"a": 160}, 30)
    r.observe("p2", {"a": 40, "b": 30}, 30)
    assert r.rates() == {"a": 3.0, "b": 1.0}
    r.observe("p1", {"a": 5}, 60)   # the guard restarted: counts from zero
    assert r.rates()["a"] == 5 / 60 + 3.0 * 0 + (40 - 10) / 30
    r.forget_except(["p2"])
    assert set(r.rates()) == {"a", "b"}


def test_a_replica_read_once_has_no_rate_yet():
    r = AdapterRates()
    r.observe("p1", {"a": 100}, 0)
    assert r.rates() == {}


# --- desired ----------------------------------------------------------------------------------------

def test_plan_gives_each_replica_a_set_within_its_cache_sticky_to_holders():
    idx = AdapterIndex()
    for n in "abcd":
        idx.upsert(body(n))
    reports = {"p1": report(("c", "Loaded")), "p2": report()}
    plan = desired.plan(idx.of("ml", "chat"), ["p1", "p2"], lora(maxAdaptersPerBatch=2), reports,
                        {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0})
    assert sum(len(s.adapters) for s in plan.sets.values()) == 4
    assert all(len(s.adapters) == 2 for s in plan.sets.values())
    assert "c" in [a.name for a in plan.sets["p1"].adapters]
    assert plan.sets["p2"].adapters[0].source.uri.startswith("https://store/")


def test_plan_refuses_a_claim_the_replicas_do_not_mount_and_reads_a_mounted_one_in_place():
    idx = AdapterIndex()
    idx.upsert(body("x", source={"pvc": {"claimName": "loras", "path": "/x/"}}))
    idx.upsert(body("y", source={"pvc": {"claimName": "other"}}))
    plan = desired.plan(idx.of("ml", "chat"), ["p1"], lora(adapterClaims=["loras"]), {"p1": report()}, {})
    assert plan.sets["p1"].adapters[0].source.path == "/var/lib/gpufleet/adapter-claims/loras/x"
    assert plan.refused["y"].reason == "SourceUnreachable"
    assert "spec.engine.lora.adapterClaims" in plan.refused["y"].message


def test_needs_put_when_a_replica_restarted_or_holds_a_deleted_adapter():
    wanted = desired.plan([AdapterIndex().upsert(body("a"))], ["p1"], lora(), {"p1": report()}, {}).sets["p1"]
    assert desired.needs_put(report(), wanted)                          # restarted: holds nothing
    assert not desired.needs_put(report(("a", "Loading")), wanted)
    assert desired.needs_put(report(("a", "Loaded"), ("gone", "Loaded")), wanted)
    assert not desired.needs_put(report(("a", "Loaded"), ("gone", "Unloading")), wanted)
    assert not desired.needs_put(None, wanted)                          # unreadable: no knowing
    assert desired.needs_put(report(("a", "Loaded")), AdapterSet())


# --- status ------------------------------------------------------------------------------------------

def ready_of(s):
    return s["conditions"][0]


def test_ready_when_loaded_on_every_replica_placed():
    s = st.adapter_status("a", "chat", 3, st.Observed(
        holders=["p1", "p2"], reports={"p1": report(("a", "Loaded")), "p2": report(("a", "Loaded"))}, rate=2.5))
    assert ready_of(s)["status"] == "True" and ready_of(s)["reason"] == "Loaded"
    assert (s["loadedReplicas"], s["desiredReplicas"], s["replicas"], s["requestsPerSecond"]) == \
        (2, 2, ["p1", "p2"], "2.50")
    assert s["observedGeneration"] == 3 and ready_of(s)["observedGeneration"] == 3


def test_loading_on_one_placed_replica_is_not_ready_yet():
    s = st.adapter_status("a", "chat", 1, st.Observed(
        holders=["p1", "p2"], reports={"p1": report(("a", "Loaded")), "p2": report(("a", "Fetching"))}))
    assert (ready_of(s)["status"], ready_of(s)["reason"]) == ("False", "Loading")
    assert "loaded on p1" in ready_of(s)["message"]


def test_a_load_failure_names_the_reason_and_the_replica():
    s = st.adapter_status("a", "chat", 1, st.Observed(holders=["p1"], reports={"p1": report(
        ("a", "Failed", {"reason": "RankTooHigh", "message": "rank 64 above engine.lora.maxRank 16"}))}))
    assert ready_of(s)["reason"] == "RankTooHigh"
    assert ready_of(s)["message"] == "p1: rank 64 above engine.lora.maxRank 16"
    assert st.failure_reason(s) == "RankTooHigh"


def test_placing_without_ready_replicas_and_too_many_without_room():
    assert ready_of(st.adapter_status("a", "chat", 1, st.Observed()))["reason"] == "Placing"
    s = st.adapter_status("a", "chat", 1, st.Observed(holders=[], reports={"p1": report()}))
    assert ready_of(s)["reason"] == "TooManyAdapters"


def test_service_not_found_and_lora_disabled_say_what_to_do():
    s = st.service_not_found("chat", "ml", 2)
    assert (ready_of(s)["reason"], s["observedGeneration"]) == ("ServiceNotFound", 2)
    assert "InferenceService chat not found in namespace ml" in ready_of(s)["message"]
    s = st.lora_disabled("chat", 1)
    assert ready_of(s)["reason"] == "LoraDisabled" and "spec.engine.lora" in ready_of(s)["message"]


def test_status_is_written_only_on_change_and_small_rate_moves_are_not_one():
    seen = st.Observed(holders=["p1"], reports={"p1": report(("a", "Loaded"))}, rate=1.0)
    first = st.adapter_status("a", "chat", 1, seen)
    written = st.merged({}, first, "2024-01-01T00:00:00Z")
    assert not st.differs(written, first) and not st.rate_moved(written, first)
    small = st.adapter_status("a", "chat", 1, st.Observed(**{**seen.__dict__, "rate": 1.1}))
    assert not st.differs(written, small) and not st.rate_moved(written, small)
    # A rate that moved is a figure: worth a write of its own only when one is due (reconcile.figures).
    large = st.adapter_status("a", "chat", 1, st.Observed(**{**seen.__dict__, "rate": 2.0}))
    assert not st.differs(written, large) and st.rate_moved(written, large)
    assert st.differs(written, st.adapter_status("a", "chat", 2, seen))
    again = st.merged(written, first, "2024-01-02T00:00:00Z")
    assert ready_of(again)["lastTransitionTime"] == "2024-01-01T00:00:00Z"


def test_needs_put_when_a_replica_holds_another_source_under_a_wanted_name():
    wanted = desired.plan([AdapterIndex().upsert(body("a"))], ["p1"], lora(), {"p1": report()}, {}).sets["p1"]
    (spec,) = wanted.adapters
    swapped = msgspec.structs.replace(spec, source=AdapterSource(uri="https://attacker.example/weights.tar"))
    assert spec_digest(swapped) != spec_digest(spec)
    assert not desired.needs_put(report(("a", "Loaded", {"digest": spec_digest(spec)})), wanted)
    # Same name, the attacker's weights: the operator tells the replica its set again.
    assert desired.needs_put(report(("a", "Loaded", {"digest": spec_digest(swapped)})), wanted)
    # A guard from before digests: names are all there is to compare.
    assert not desired.needs_put(report(("a", "Loaded", {"digest": ""})), wanted)


def test_the_digest_names_the_whole_spec_and_does_not_show_a_uris_secret():
    base = AdapterSpec("a", AdapterSource(uri="https://store/a.tar?X-Amz-Signature=s3cr3t"))
    assert spec_digest(base) == spec_digest(AdapterSpec("a", AdapterSource(uri=base.source.uri)))
    for other in (msgspec.structs.replace(base, base_model="org/m"), msgspec.structs.replace(base, name="b"),
                  AdapterSpec("a", AdapterSource(path="/a"))):
        assert spec_digest(other) != spec_digest(base)
    assert spec_digest(base).startswith("sha256:") and "s3cr3t" not in spec_digest(base)
