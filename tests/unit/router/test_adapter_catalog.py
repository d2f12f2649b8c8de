"""Which service and adapter a request's ``model`` names (adapters.py), which
replicas hold an adapter (signals.py, from the guard's adapter_state gauge),
and the choice among them only (choice.py), round robin included."""
from __future__ import annotations

from gpufleet_router.policy.adapters import (
    LISTED_IN_404,
    Catalog,
    build_catalog,
    not_found_message,
    resolve,
    served,
    source_root,
)
from gpufleet_router.policy.choice import Picker, Policy, Reason
from gpufleet_router.policy.prefixes import prefix_of
from gpufleet_router.policy.replicas import Reading, Replica
from gpufleet_router.policy.signals import parse_guard
from gpufleet_router.policy.table import Table, build_table
from tests.unit.router.test_requests_and_table import GUARD_METRICS, isvc, pod, serving


def adapter(name: str, service: str, ns: str = "ml", created: str = "2026-01-02T00:00:00Z", **source) -> dict:
    return {"metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
            "spec": {"service": service, "source": source or {"huggingFace": {"name": f"org/{name}"}}}}


SERVICES = [isvc("chat", servedName="chat-v1"), isvc("embed", ns="other")]
PODS = [pod("chat-1", "chat", "10.0.0.1")]


def routed(items: list[dict], services: list[dict] = SERVICES) -> tuple[Table, Catalog]:
    """The table and the catalog as the router builds them: both over the same adapters."""
    table = build_table(services, PODS, serving, adapters=items)
    return table, build_catalog(items, table)


def test_an_adapter_resolves_to_its_service_and_a_base_model_to_its_own():
    table, catalog = routed([adapter("support-lora", "chat")])
    target = resolve("support-lora", table, catalog)
    assert target is not None and target.route.service == "chat" and target.adapter is not None
    assert (target.adapter.parent, target.adapter.root) == ("chat-v1", "org/support-lora")
    base = resolve("chat-v1", table, catalog)
    assert base is not None and base.route.service == "chat" and base.adapter is None
    assert resolve("gpt-9", table, catalog) is None
    assert served(table, catalog) == ["chat-v1", "org/embed", "support-lora"]


def test_adapters_that_cannot_be_served_are_left_out_with_a_reason():
    table, catalog = routed([
        adapter("lost", "nowhere"),                         # no such service
        adapter("cross", "embed"),                          # its service is in another namespace
        adapter("chat-v1", "chat"),                         # a base model's name: the model keeps it
        adapter("dup", "chat", created="2026-01-03T00:00:00Z"),
        adapter("dup", "embed", ns="other", created="2026-01-01T00:00:00Z"),   # older: keeps the name
        {**adapter("going", "chat"), "metadata": {"name": "going", "namespace": "ml",
                                                  "deletionTimestamp": "2026-01-04T00:00:00Z"}},
    ])
    assert sorted(catalog.adapters) == ["dup"] and catalog.adapters["dup"].service == "embed"
    problems = "\n".join(catalog.problems)
    assert "ml/lost" in problems and "ml/cross" in problems and "ml/chat-v1" in problems
    assert "ml/dup" in problems and "going" not in problems
    target = resolve("chat-v1", table, catalog)
    assert target is not None and target.adapter is None


def test_an_adapters_root_is_its_source_without_credentials():
    assert source_root({"huggingFace": {"name": "org/a", "revision": "v2"}}) == "org/a@v2"
    assert source_root({"pvc": {"claimName": "loras", "path": "/team/a"}}) == "pvc://loras/team/a"
    assert source_root({"uri": "https://user:pw@bucket.example:443/a.tar?X-Amz-Signature=s#f"}) == \
        "https://bucket.example/a.tar"
    assert source_root({}) == "" and source_root(None) == ""


def test_the_unknown_model_message_is_vllms_and_names_at_most_twenty_served_models():
    table, catalog = routed([adapter(f"lora-{i:02d}", "chat") for i in range(30)])
    message = not_found_message("gpt-9", table, catalog)
    assert message.startswith("The model `gpt-9` does not exist. Served here: chat-v1, lora-00, ")
    assert message.count(", ") == LISTED_IN_404 - 1 and "and 12 more (GET /v1/models lists them all)" in message
    assert not_found_message("x", build_table([], [], serving), build_catalog([], table)) == \
        "The model `x` does not exist. Served here: (none)."


def test_a_reading_lists_the_adapters_the_guard_holds_loaded_and_no_other():
    text = GUARD_METRICS + ('gpufleet_guard_adapter_state{adapter="a",state="Loaded"} 1.0\n'
                            'gpufleet_guard_adapter_state{adapter="b",state="Loading"} 1.0\n'
                            'gpufleet_guard_adapter_state{adapter="c",state="Loaded"} 0.0\n'
                            'gpufleet_guard_adapter_state{adapter="c",state="Failed"} 1.0\n')
    assert parse_guard(text, 0.0).adapters == frozenset({"a"})
    assert parse_guard(GUARD_METRICS, 0.0).adapters == frozenset()


def test_the_guards_own_adapter_gauge_is_the_one_parsed():
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    from gpufleet_api.guard import guard_metrics as guard
    registry = CollectorRegistry()
    Gauge(guard.ADAPTER_STATE, "", ["adapter", "state"], registry=registry).labels("a", "Loaded").set(1)
    assert parse_guard(GUARD_METRICS + generate_latest(registry).decode(), 0.0).adapters == {"a"}


def picker(policy: str = Policy.KV_AWARE, **holding: tuple[str, ...]) -> Picker:
    """Replicas a, b, c; ``holding[pod]``: the adapters its reading lists; b has the most room."""
    p = Picker(policy=policy)
    p.set_replicas([Replica(name, f"{name}:8080") for name in ("a", "b", "c")])
    for name, free in (("a", 10), ("b", 90), ("c", 50)):
        p.observe(name, Reading(0.0, True, free, 100, adapters=frozenset(holding.get(name, ()))))
    return p


def test_an_adapter_request_goes_only_to_its_holders_and_the_policy_chooses_among_them():
    p = picker(a=("x",), c=("x", "y"))
    assert [r.pod for r in p.holders("x")] == ["a", "c"]
    pick = p.pick(4, None, adapter="x")
    assert pick is not None and pick.replica.pod == "c" and pick.reason == Reason.KV   # c has more room than a
    retry = p.pick(4, None, exclude=["c"], adapter="x")
    assert retry is not None and retry.replica.pod == "a"                               # never b
    assert p.pick(4, None, exclude=["a", "c"], adapter="x") is None
    assert p.pick(4, None, adapter="z") is None
    base = p.pick(4, None)
    assert base is not None and base.replica.pod == "b"


def test_a_replica_never_read_or_not_ready_holds_nothing_it_can_serve():
    p = picker(a=("x",), b=("x",))
    p.set_replicas([*p.replicas.values(), Replica("d", "d:8080")])         # new: not read yet
    p.observe("b", Reading(0.0, False, 90, 100, adapters=frozenset({"x"})))
    p.observe("a", Reading(0.0, True, 90, 100, adapters=frozenset()))       # unloaded since
    assert p.holders("x") == [] and p.pick(1, None, adapter="x") is None


def test_a_failed_read_does_not_unsay_the_adapters_a_replica_holds():
    # A guard too busy to answer /metrics within the reading timeout (its node starting another engine)
    # still holds its adapters: its adapter requests keep going to it, as its base-model requests do.
    p = picker(a=("x",), b=())
    p.observe("a", None)
    assert [r.pod for r in p.holders("x")] == ["a"]
    pick = p.pick(1, None, adapter="x")
    assert pick is not None and pick.replica.pod == "a"
    # Its engine restarted (its pod not serving, then serving again): its adapters are known again only
    # from a reading after the restart.
    p.set_replicas([Replica("a", "a:8080", serving=False), Replica("b", "b:8080"), Replica("c", "c:8080")])
    p.set_replicas([Replica("a", "a:8080"), Replica("b", "b:8080"), Replica("c", "c:8080")])
    assert p.holders("x") == []
    # Gone from the table: forgotten.
    p.observe("a", Reading(1.0, True, 90, 100, adapters=frozenset({"x"})))
    p.set_replicas([Replica("b", "b:8080"), Replica("c", "c:8080")])
    assert "a" not in p.adapters and p.holders("x") == []


def test_prefix_affinity_among_holders_keys_the_prompt_by_adapter():
    prompt = "You are the support assistant for ACME. " * 20
    base, x = prefix_of(prompt, 64, 4), prefix_of(prompt, 64, 4, adapter="x")
    assert base is not None and x is not None and base.chain != x.chain and len(base.chain) == len(x.chain)
    assert x == prefix_of(prompt, 64, 4, adapter="x")
    p = picker(a=("x",), b=("x",), c=("x",))
    first = p.pick(4, x, adapter="x")
    assert first is not None
    p.sent(first.replica.pod, 4, 1.0, x)
    again = p.pick(4, x, adapter="x")
    assert again is not None and again.replica.pod == first.replica.pod and again.affinity_hit


def test_round_robin_takes_each_eligible_replica_in_turn_and_only_holders_for_an_adapter():
    p = picker(Policy.ROUND_ROBIN, a=("x",), c=("x",))
    picks = [p.pick(1, None) for _ in range(6)]
    assert [x.replica.pod for x in picks if x] == ["a", "b", "c", "a", "b", "c"]
    assert {x.reason for x in picks if x} == {Reason.ROUND_ROBIN}
    adapter_picks = [p.pick(1, None, adapter="x") for _ in range(4)]
    assert sorted(x.replica.pod for x in adapter_picks if x) == ["a", "a", "c", "c"]
    p.observe("b", Reading(0.0, False, 0, 100))
    assert {x.replica.pod for x in (p.pick(1, None) for _ in range(4)) if x} == {"a", "c"}
