"""What the router reads from a request (requests.py), from a guard's
/metrics (signals.py) and from the API server's objects (table.py)."""
from __future__ import annotations

import json

import pytest

from gpufleet_router.policy import requests as rq
from gpufleet_router.policy.signals import UnreadableMetrics, parse_guard
from gpufleet_router.policy.table import build_table

GUARD_METRICS = """\
gpufleet_guard_kv_free_blocks 50.0
gpufleet_guard_kv_reserved_blocks 30.0
gpufleet_guard_kv_total_blocks 64.0
gpufleet_guard_kv_watermark_blocks 4.0
gpufleet_guard_ready 1.0
gpufleet_guard_queue_depth{class="interactive"} 2.0
gpufleet_guard_queue_depth{class="batch"} 1.0
"""


def test_a_guard_reading_is_the_smaller_of_free_over_the_watermark_and_unreserved():
    r = parse_guard(GUARD_METRICS, taken_at=3.0)
    assert (r.free_blocks, r.total_blocks, r.ready, r.queued, r.taken_at) == (34, 64, True, 3, 3.0)
    r = parse_guard(GUARD_METRICS.replace("reserved_blocks 30.0", "reserved_blocks 0.0"), 0.0)
    assert r.free_blocks == 46
    assert not parse_guard(GUARD_METRICS.replace("ready 1.0", "ready 0.0"), 0.0).ready


def test_a_reading_without_the_ledger_is_unreadable_not_empty():
    with pytest.raises(UnreadableMetrics, match="gpufleet_guard_kv_total_blocks"):
        parse_guard(GUARD_METRICS.replace("gpufleet_guard_kv_total_blocks 64.0\n", ""), 0.0)


def test_the_guards_own_metric_names_are_the_ones_parsed():
    from gpufleet_engine.serving.prometheus import GuardMetrics
    m = GuardMetrics(["interactive"])
    m.kv_free_blocks.set(10)
    m.kv_total_blocks.set(20)
    m.kv_watermark_blocks.set(1)
    m.ready.set(1)
    assert parse_guard(m.render().decode(), 0.0).free_blocks == 9


def body(**doc) -> bytes:
    return json.dumps(doc).encode()


def test_chat_prompt_text_keeps_the_messages_in_order():
    p = rq.parse(body(model="m", messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                      max_tokens=10, stream=True), rq.CHAT)
    assert p.prompt == "system\nBe brief.\nuser\nHi\n" and p.max_tokens == 10 and p.stream
    assert rq.parse(body(model="m", prompt=["a", "b"]), rq.COMPLETIONS).prompt == "ab"
    assert rq.parse(body(model="m", prompt=[1, 2, 3]), rq.COMPLETIONS).prompt == "1 2 3"
    assert rq.parse(body(model="m", input="text"), rq.EMBEDDINGS).prompt == "text"


def test_the_cost_estimate_counts_prompt_and_output_in_blocks():
    p = rq.parse(body(model="m", prompt="x" * 400, max_tokens=28), rq.COMPLETIONS)
    assert p.cost_blocks(16, rq.COMPLETIONS) == 8          # 100 + 28 tokens
    assert p.cost_blocks(16, rq.EMBEDDINGS) == 7            # no output
    no_max = rq.parse(body(model="m", prompt="x"), rq.COMPLETIONS)
    assert no_max.cost_blocks(16, rq.COMPLETIONS) == (1 + rq.DEFAULT_OUTPUT_TOKENS + 15) // 16


@pytest.mark.parametrize("raw, status, param, fragment", [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object, not list"),
    (body(prompt="hi"), 400, "model", "no `model`"),
    (body(model="", prompt="hi"), 400, "model", "non-empty string"),
    (body(model=3, prompt="hi"), 400, "model", "non-empty string"),
    (body(model="m", max_tokens="10"), 400, "max_tokens", "must be an integer"),
    (b"\xff\xfe", 400, None, "not valid JSON"),
])
def test_bad_requests_name_the_problem_in_the_openai_format(raw, status, param, fragment):
    with pytest.raises(rq.BadRequest) as e:
        rq.parse(raw, rq.COMPLETIONS)
    err = e.value.body()["error"]
    assert e.value.status == status and err["param"] == param and fragment in err["message"]
    assert err["type"] == "invalid_request_error"


def isvc(name: str, ns: str = "ml", created: str = "2026-01-01T00:00:00Z", **model) -> dict:
    return {"metadata": {"name": name, "namespace": ns, "creationTimestamp": created},
            "spec": {"model": {"name": f"org/{name}", **model},
                     "engine": {"kvCache": {"blockSize": 32}},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}}


def pod(name: str, service: str, ip: str | None, ns: str = "ml", ready: bool = True) -> dict:
    return {"metadata": {"name": name, "namespace": ns, "labels": {"gpufleet.dev/service": service}},
            "status": {"podIP": ip, "ready": ready}}


def serving(p: dict) -> bool:
    return p["status"]["ready"]


def test_each_service_is_routed_by_its_served_name_with_its_pods_as_replicas():
    table = build_table([isvc("chat", servedName="chat-v1"), isvc("embed")],
                        [pod("chat-1", "chat", "10.0.0.1"), pod("chat-2", "chat", "10.0.0.2", ready=False),
                         pod("chat-3", "chat", None), pod("other", "chat", "10.0.0.9", ns="elsewhere")],
                        serving)
    assert table.models == ["chat-v1", "org/embed"]
    chat = table.routes["chat-v1"]
    assert (chat.service, chat.block_size, chat.min_replicas, chat.max_replicas) == ("chat", 32, 1, 3)
    assert [(r.pod, r.address, r.serving) for r in chat.replicas] == [
        ("chat-1", "10.0.0.1:8080", True), ("chat-2", "10.0.0.2:8080", False)]
    assert table.routes["org/embed"].replicas == ()


def test_a_model_name_claimed_twice_goes_to_the_older_service_and_the_other_is_reported():
    table = build_table([isvc("b", ns="two", created="2026-02-01T00:00:00Z", servedName="m"),
                         isvc("a", ns="one", created="2026-03-01T00:00:00Z", servedName="m")], [], serving)
    assert table.routes["m"].namespace == "two"
    assert len(table.problems) == 1 and "one/a" in table.problems[0] and "servedName" in table.problems[0]


def test_an_invalid_or_deleted_service_is_left_out():
    bad = isvc("bad")
    bad["spec"]["autoscaling"]["minReplicas"] = "many"
    gone = isvc("gone")
    gone["metadata"]["deletionTimestamp"] = "2026-01-02T00:00:00Z"
    table = build_table([bad, gone, isvc("fine")], [], serving)
    assert table.models == ["org/fine"]
    assert len(table.problems) == 1 and "ml/bad" in table.problems[0]


def test_a_services_pods_are_split_into_pools_by_their_role_label():
    def role_pod(name: str, ip: str, role: str | None) -> dict:
        p = pod(name, "chat", ip)
        if role is not None:
            p["metadata"]["labels"]["gpufleet.dev/role"] = role
        return p
    table = build_table([isvc("chat")], [role_pod("chat-p-1", "10.0.0.1", "prefill"),
                                         role_pod("chat-d-2", "10.0.0.3", "decode"),
                                         role_pod("chat-d-1", "10.0.0.2", "decode"),
                                         role_pod("chat-engine-1", "10.0.0.4", None),
                                         role_pod("chat-x-1", "10.0.0.5", "encode")], serving)
    route = table.routes["org/chat"]
    assert [r.pod for r in route.prefill] == ["chat-p-1"]
    assert [r.pod for r in route.decode] == ["chat-d-1", "chat-d-2"]
    assert [r.pod for r in route.replicas] == ["chat-engine-1"] == [r.pod for r in route.pool("unified")]
    # A pool the router does not know gets nothing, and the table says why.
    assert table.problems == ("ml/chat-x-1: gpufleet.dev/role='encode' is not prefill or decode; the pod gets no "
                              "requests",)


def test_a_disaggregated_service_bounds_each_pool_by_its_own_max_replicas():
    pd = isvc("chat")
    pd["spec"]["engine"]["kvTransfer"] = {"connector": "Nixl"}
    pd["spec"]["disaggregation"] = {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 6}}
    route = build_table([pd, isvc("solo")], [], serving).routes
    assert (route["org/chat"].max_of("prefill"), route["org/chat"].max_of("decode")) == (2, 6)
    assert route["org/solo"].max_of("unified") == 3


def test_a_shared_kv_tier_balances_load_tightly_since_a_spilled_prefix_is_loaded_not_computed():
    from gpufleet_router.metrics import RouterMetrics
    from gpufleet_router.policy.prefixes import Prefix, prefix_of
    from gpufleet_router.policy.replicas import Replica
    from gpufleet_router.server import Fleet, RouterSettings

    tier = isvc("chat")
    tier["spec"]["engine"].update(kvTier="Shared", kvTransfer={"connector": "LMCache"})
    table = build_table([tier, isvc("solo")], [pod("chat-1", "chat", "10.0.0.1"), pod("chat-2", "chat", "10.0.0.2"),
                                               pod("solo-1", "solo", "10.0.0.3"), pod("solo-2", "solo", "10.0.0.4")],
                        serving)
    assert table.routes["org/chat"].kv_tier and not table.routes["org/solo"].kv_tier
    fleet = Fleet(RouterSettings(), RouterMetrics())
    fleet.update(table)

    def spilled_after(model: str) -> int:
        """Requests of one hot prefix in flight before one goes to the other replica."""
        picker = fleet.picker(model, "unified")
        prefix = prefix_of("You are a billing assistant. " * 40, 32 * 4, 4)
        assert isinstance(prefix, Prefix)
        first = None
        for n in range(1, 20):
            pick = picker.pick(1, prefix)
            assert pick is not None and isinstance(pick.replica, Replica)
            first = first or pick.replica.pod
            if pick.replica.pod != first:
                return n
            picker.sent(pick.replica.pod, 1, 0.0, prefix)
        return 20
    tight, loose = spilled_after("org/chat"), spilled_after("org/solo")
    assert tight < loose, (tight, loose)
