"""The requests a disaggregated service's pools get (handoff.py): the prefill
cut to one token, not streamed, asking vLLM to keep the KV for a remote
decode; the decode the client's own request with what the prefill returned."""
from __future__ import annotations

import json

import pytest

from gpufleet_router.policy import handoff
from gpufleet_router.policy import requests as rq

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_a_completion_is_prefilled_with_one_token_whole_and_vllms_remote_decode_request():
    client = {"model": "m", "prompt": "p", "max_tokens": 64, "stream": True,
              "stream_options": {"include_usage": True}, "temperature": 0.2}
    sent = json.loads(handoff.prefill_body(json.dumps(client).encode(), rq.COMPLETIONS))
    assert sent == {"model": "m", "prompt": "p", "max_tokens": 1, "min_tokens": 1, "stream": False,
                    "temperature": 0.2, "kv_transfer_params": PREFILL_PARAMS}


def test_a_chat_request_is_cut_to_one_token_even_with_max_completion_tokens():
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50}
    sent = json.loads(handoff.prefill_body(json.dumps(client).encode(), rq.CHAT))
    assert (sent["max_tokens"], sent["max_completion_tokens"], sent["min_tokens"], sent["stream"]) == (1, 1, 1, False)
    assert sent["messages"] == client["messages"] and sent["kv_transfer_params"] == PREFILL_PARAMS


def test_decode_gets_the_clients_bytes_unchanged_without_a_prefill():
    body = b'{"model": "m",  "prompt": "p", "stream": true}'
    assert handoff.decode_body(body, None) is body


def test_after_a_prefill_that_returned_nothing_decode_gets_null_params_as_vllm_router_sends():
    body = b'{"model": "m", "prompt": "p"}'
    assert json.loads(handoff.decode_body(body, handoff.Handoff(None))) == {
        "model": "m", "prompt": "p", "kv_transfer_params": None}


def test_decode_gets_the_returned_params_and_never_a_clients_own():
    params = {"remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "10.0.0.5", "remote_port": 5600,
              "do_remote_prefill": True, "do_remote_decode": False}
    body = json.dumps({"model": "m", "prompt": "p", "stream": True}).encode()
    assert json.loads(handoff.decode_body(body, handoff.Handoff(params))) == {
        "model": "m", "prompt": "p", "stream": True, "kv_transfer_params": params}
    own = json.dumps({"model": "m", "prompt": "p", "kv_transfer_params": {"do_remote_prefill": True}}).encode()
    assert json.loads(handoff.decode_body(own, None)) == {"model": "m", "prompt": "p"}


def test_the_params_are_read_from_the_top_of_the_prefills_answer():
    answer = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
              "kv_transfer_params": {"remote_engine_id": "e1"}}
    assert handoff.returned_params(json.dumps(answer).encode()) == {"remote_engine_id": "e1"}
    del answer["kv_transfer_params"]
    assert handoff.returned_params(json.dumps(answer).encode()) is None
    assert handoff.returned_params(json.dumps({**answer, "kv_transfer_params": None}).encode()) is None


@pytest.mark.parametrize("answer, fragment", [
    (b"<html>bad gateway</html>", "not JSON"),
    (b"[1]", "not an object"),
    (b'{"kv_transfer_params": "e1"}', "kv_transfer_params is a str"),
])
def test_an_answer_that_is_not_a_completion_is_unreadable(answer, fragment):
    with pytest.raises(handoff.UnreadableAnswer, match=fragment):
        handoff.returned_params(answer)
