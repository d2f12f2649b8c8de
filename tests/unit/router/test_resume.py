"""resume.py: which streamed requests can be continued on another replica, the continuation request, and
the events the client sees across replicas (one id, one role, usage counting the whole answer)."""
from __future__ import annotations

import json

import pytest

from gpufleet_router.policy import resume
from gpufleet_router.policy.requests import CHAT, COMPLETIONS, EMBEDDINGS

ID, CREATED, MODEL = "cmpl-1", 111, "tiny"


def sse(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def completion_chunk(text: str, tokens: int | None = None, prompt: int = 7, finish: str | None = None,
                     id_: str = ID, created: int = CREATED) -> bytes:
    chunk: dict = {"id": id_, "object": "text_completion", "created": created, "model": MODEL,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if tokens is not None:
        chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    return sse(chunk)


def chat_chunk(delta: dict, tokens: int | None = None, prompt: int = 9, finish: str | None = None,
               id_: str = "chatcmpl-1", created: int = CREATED) -> bytes:
    chunk: dict = {"id": id_, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if tokens is not None:
        chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    return sse(chunk)


def usage_chunk(prompt: int, tokens: int, object_: str = "text_completion", id_: str = ID) -> bytes:
    return sse({"id": id_, "object": object_, "created": CREATED, "model": MODEL, "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}})


def decode(events: list[bytes]) -> list:
    out = []
    for event in events:
        for part in event.split(b"\n\n"):
            if part:
                data = part.removeprefix(b"data: ")
                out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("doc,route,why", [
    ({"prompt": "a", "n": 2}, COMPLETIONS, "n > 1"),
    ({"prompt": "a", "best_of": 3}, COMPLETIONS, "best_of"),
    ({"prompt": "a", "use_beam_search": True}, COMPLETIONS, "beam search"),
    ({"prompt": "a", "echo": True}, COMPLETIONS, "echo"),
    ({"prompt": "a", "logprobs": 0}, COMPLETIONS, "logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, CHAT, "logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, CHAT, "logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, CHAT, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, CHAT, "tool_choice"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}, CHAT,
     "response_format"),
    ({"prompt": "a", "guided_json": {"type": "object"}}, COMPLETIONS, "guided_json"),
    ({"prompt": "a", "structured_outputs": {"regex": "a+"}}, COMPLETIONS, "structured_outputs"),
    ({"prompt": [1, 2, 3]}, COMPLETIONS, "token ids"),
    ({"prompt": ["a", "b"]}, COMPLETIONS, "several prompts"),
    ({"messages": []}, CHAT, "no messages"),
    ({"input": "a"}, EMBEDDINGS, "not resumed"),
])
def test_what_cannot_be_continued_faithfully_is_named(doc, route, why):
    assert why in (resume.not_resumable(doc, route) or "")


@pytest.mark.parametrize("doc,route", [
    ({"prompt": "a", "max_tokens": 5, "temperature": 0.7, "seed": 3, "stop": ["\n"]}, COMPLETIONS),
    ({"prompt": ["a"], "n": 1, "logprobs": None}, COMPLETIONS),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": False, "tools": [{"type": "function"}],
      "tool_choice": "none"}, CHAT),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "text"}}, CHAT),
])
def test_plain_sampling_is_resumable(doc, route):
    assert resume.not_resumable(doc, route) is None


def test_upstream_asks_for_usage_in_every_chunk_keeping_the_clients_options():
    body = resume.upstream_body({"prompt": "a", "stream_options": {"include_usage": False, "x": 1}})
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True, "x": 1}


def test_a_completion_continues_from_the_prompt_plus_the_text_sent_with_the_rest_of_its_budget():
    s = resume.Stream({"model": MODEL, "prompt": "Once", "max_tokens": 10, "min_tokens": 4, "stream": True},
                      COMPLETIONS)
    out = s.feed(completion_chunk(" upon", 1) + completion_chunk(" a", 2) + completion_chunk(" ti", 3)[:20])
    assert [c["choices"][0]["text"] for c in decode(out)] == [" upon", " a"]
    assert all("usage" not in c for c in decode(out))        # the client did not ask for usage
    s.broke()                                               # the half event is dropped
    doc = s.continuation()
    assert doc["prompt"] == "Once upon a" and doc["max_tokens"] == 8 and doc["min_tokens"] == 2
    assert doc["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert s.doc["prompt"] == "Once"                          # the original is kept for the next break


def test_a_list_of_one_prompt_stays_a_list():
    s = resume.Stream({"prompt": ["Once"]}, COMPLETIONS)
    s.feed(completion_chunk(" upon", 1))
    s.broke()
    assert s.continuation()["prompt"] == ["Once upon"]


def test_the_resumed_answer_has_the_first_ones_id_and_usage_counts_the_whole_answer():
    s = resume.Stream({"prompt": "Once", "stream": True, "stream_options": {"include_usage": True}},
                      COMPLETIONS)
    s.feed(completion_chunk(" upon", 1, prompt=4) + completion_chunk(" a", 2, prompt=4))
    s.broke()
    # The second replica's prompt is longer (it includes the text sent) and its ids are its own.
    out = decode(s.feed(completion_chunk(" time", 1, prompt=6, id_="cmpl-2", created=222)
                        + completion_chunk("", 2, prompt=6, finish="stop", id_="cmpl-2", created=222)
                        + usage_chunk(6, 2, id_="cmpl-2") + b"data: [DONE]\n\n"))
    assert [(c["id"], c["created"]) for c in out[:-1]] == [(ID, CREATED)] * 3
    assert all("usage" not in c for c in out[:2])             # usage at the end only, as asked
    assert out[2]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert out[-1] == "[DONE]" and s.done and s.text == " upon a time" and s.tokens == 4


def test_continuous_usage_asked_by_the_client_is_rewritten_in_every_chunk():
    s = resume.Stream({"prompt": "Once", "stream_options": {"include_usage": True,
                                                            "continuous_usage_stats": True}}, COMPLETIONS)
    first = decode(s.feed(completion_chunk(" upon", 1, prompt=4)))
    assert first[0]["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    s.broke()
    resumed = decode(s.feed(completion_chunk(" a", 1, prompt=5)))
    assert resumed[0]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


def test_without_usage_from_the_replica_each_chunk_with_text_is_a_token():
    s = resume.Stream({"prompt": "Once", "max_tokens": 3}, COMPLETIONS)
    s.feed(completion_chunk(" upon") + completion_chunk(" a"))
    assert s.tokens == 2 and not s.finished
    s.feed(completion_chunk(" time"))
    assert s.finished                                         # its token budget is spent


def test_unchanged_events_pass_byte_for_byte():
    s = resume.Stream({"prompt": "Once", "stream_options": {"include_usage": True}}, COMPLETIONS)
    raw = b'data: {"id": "x", "choices": [{"text": "a", "finish_reason": null}]}\n\n: ping\n\n'
    assert b"".join(s.feed(raw)) == raw


def test_a_chat_continues_the_assistant_message_without_a_second_role():
    doc = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 6, "stream": True}
    s = resume.Stream(doc, CHAT)
    first = decode(s.feed(chat_chunk({"role": "assistant", "content": ""}, 0)
                          + chat_chunk({"content": "Hello"}, 1) + chat_chunk({"content": " there"}, 2)))
    assert first[0]["choices"][0]["delta"]["role"] == "assistant"
    s.broke()
    cont = s.continuation()
    assert cont["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
    assert cont["max_completion_tokens"] == 4
    out = decode(s.feed(chat_chunk({"role": "assistant", "content": ""}, 0, id_="chatcmpl-2")
                        + chat_chunk({"content": "!"}, 1, id_="chatcmpl-2")
                        + chat_chunk({"content": ""}, 1, finish="stop", id_="chatcmpl-2")
                        + usage_chunk(12, 1, "chat.completion.chunk", "chatcmpl-2") + b"data: [DONE]\n\n"))
    assert [c["choices"][0]["delta"] for c in out[:-1]] == [{"content": "!"}, {"content": ""}]
    assert {c["id"] for c in out[:-1]} == {"chatcmpl-1"} and out[-1] == "[DONE]"
    assert s.finish_reason == "stop" and s.tokens == 3


def test_a_chat_the_client_already_continues_gets_the_text_appended_to_its_message():
    doc = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}],
           "continue_final_message": True, "add_generation_prompt": False}
    s = resume.Stream(doc, CHAT)
    s.feed(chat_chunk({"content": " yes"}, 1))
    s.broke()
    assert s.continuation()["messages"][-1] == {"role": "assistant", "content": "Well, yes"}


def test_a_break_before_any_text_sends_the_request_itself():
    doc = {"messages": [{"role": "user", "content": "Hi"}], "n": 2}
    s = resume.Stream(doc, CHAT)
    assert s.why_not() is None                               # nothing sent yet: any request may go again
    s.broke()
    assert s.continuation()["messages"] == doc["messages"] and "continue_final_message" not in s.continuation()


def test_reasoning_or_tool_calls_in_the_answer_refuse_resumption():
    s = resume.Stream({"messages": [{"role": "user", "content": "Hi"}]}, CHAT)
    s.feed(chat_chunk({"reasoning_content": "hmm"}, 1))
    assert "reasoning" in (s.why_not() or "")


def test_an_error_event_from_the_replica_is_its_answer_not_a_break():
    s = resume.Stream({"prompt": "a"}, COMPLETIONS)
    out = s.feed(completion_chunk("x", 1) + b'data: {"error": {"message": "boom"}}\n\n')
    assert len(out) == 2 and s.why_not() == "the replica answered an error"


def test_an_answer_that_ended_before_the_break_gets_its_usage_and_done():
    s = resume.Stream({"prompt": "a", "stream_options": {"include_usage": True}}, COMPLETIONS)
    s.feed(completion_chunk("x", 1, prompt=2) + completion_chunk("", 1, prompt=2, finish="stop"))
    s.broke()
    assert s.finished
    out = decode([s.ending()])
    assert out == [{"id": ID, "object": "text_completion", "created": CREATED, "model": MODEL, "choices": [],
                    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}, "[DONE]"]


def test_an_answer_at_its_token_limit_ends_with_length():
    s = resume.Stream({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}, CHAT)
    s.feed(chat_chunk({"content": "Yo"}, 1))
    s.broke()
    out = decode([s.ending()])
    assert out[0]["choices"] == [{"index": 0, "finish_reason": "length", "delta": {"content": ""}}]
    assert out[-1] == "[DONE]" and len(out) == 2              # no usage: not asked for


def test_the_error_event_is_openai_shaped_then_done():
    out = decode([resume.error_event("why", resume.Code.NOT_RESUMABLE)])
    assert out == [{"error": {"message": "why", "type": "server_error", "param": None,
                              "code": "stream_not_resumable"}}, "[DONE]"]


def test_a_second_done_is_not_sent_twice():
    s = resume.Stream({"prompt": "a"}, COMPLETIONS)
    assert s.feed(b"data: [DONE]\n\n") == [resume.DONE]
    assert s.feed(b"data: [DONE]\n\n") == []
