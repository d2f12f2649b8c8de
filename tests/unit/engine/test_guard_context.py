"""Context limits before vLLM: counts, Reject, TruncateLeft."""
from __future__ import annotations

import pytest

from gpufleet_engine.context import CHAT, COMPLETIONS, ContextTooLong, InvalidRequest, Limits, prepare

REJECT = Limits(100, truncate_left=False)
TRUNCATE = Limits(100, truncate_left=True)


def words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


def test_a_prompt_within_the_limit_is_forwarded_unchanged(tokenizer):
    body = {"model": "m", "prompt": words(60), "max_tokens": 40}
    p = prepare(COMPLETIONS, body, tokenizer, REJECT)
    assert p.body is body and not p.changed
    assert p.prompt_tokens == [60] and p.max_tokens == 40 and p.block_cost(32) == 4


def test_reject_names_the_token_counts(tokenizer):
    with pytest.raises(ContextTooLong) as e:
        prepare(COMPLETIONS, {"prompt": words(70), "max_tokens": 40}, tokenizer, REJECT)
    assert str(e.value) == ("This request has 70 prompt tokens and asks for 40 completion tokens, 110 in "
                            "total, but the maximum context is 100 tokens. Shorten the prompt or lower "
                            "max_tokens.")


def test_truncate_left_keeps_the_newest_tokens_and_sends_token_ids(tokenizer):
    prompt = " ".join(["a"] * 30 + ["bbbb"] * 40)   # ids: 1 ×30, then 4 ×40
    p = prepare(COMPLETIONS, {"prompt": prompt, "max_tokens": 50}, tokenizer, TRUNCATE)
    assert p.body["prompt"] == [1] * 10 + [4] * 40
    assert p.prompt_tokens == [50] and p.truncated_tokens == 20 and p.changed


def test_truncate_left_cannot_help_when_max_tokens_alone_fills_the_context(tokenizer):
    with pytest.raises(ContextTooLong, match="asks for 100 completion tokens"):
        prepare(COMPLETIONS, {"prompt": words(5), "max_tokens": 100}, tokenizer, TRUNCATE)


def test_without_max_tokens_the_rest_of_the_context_is_the_budget_and_is_made_explicit(tokenizer):
    p = prepare(COMPLETIONS, {"prompt": words(30)}, tokenizer, REJECT)
    assert p.max_tokens == 70 and p.body["max_tokens"] == 70 and p.block_cost(32) == 4


def test_without_max_tokens_a_full_prompt_is_rejected_or_cut_to_leave_one_token(tokenizer):
    with pytest.raises(ContextTooLong, match="has 120 prompt tokens"):
        prepare(COMPLETIONS, {"prompt": words(120)}, tokenizer, REJECT)
    p = prepare(COMPLETIONS, {"prompt": words(120)}, tokenizer, TRUNCATE)
    assert p.prompt_tokens == [99] and p.max_tokens == 1


def test_token_id_prompts_are_counted_as_given(tokenizer):
    p = prepare(COMPLETIONS, {"prompt": list(range(80)), "max_tokens": 10}, tokenizer, REJECT)
    assert p.prompt_tokens == [80]


def test_batches_cost_every_prompt_and_every_sequence(tokenizer):
    body = {"prompt": [words(10), words(40)], "max_tokens": 22, "n": 2}
    p = prepare(COMPLETIONS, body, tokenizer, REJECT)
    assert p.prompt_tokens == [10, 40]
    assert p.block_cost(32) == 2 * 1 + 2 * 2


def test_batch_truncation_cuts_only_the_prompts_that_are_too_long(tokenizer):
    body = {"prompt": [words(10), words(90)], "max_tokens": 20}
    p = prepare(COMPLETIONS, body, tokenizer, TRUNCATE)
    assert p.body["prompt"][0] == words(10) and len(p.body["prompt"][1]) == 80


def test_chat_is_counted_with_the_template(tokenizer):
    body = {"messages": [{"role": "system", "content": words(5)}, {"role": "user", "content": words(10)}],
            "max_tokens": 10}
    assert prepare(CHAT, body, tokenizer, REJECT).prompt_tokens == [(3 + 5) + (3 + 10) + 2]


def test_chat_text_parts_count_like_a_string(tokenizer):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": words(4)},
                                                      {"type": "text", "text": words(3)}]}]}
    assert prepare(CHAT, body, tokenizer, REJECT).prompt_tokens == [3 + 7 + 2]


def test_max_completion_tokens_wins_for_chat(tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7, "max_tokens": 50}
    assert prepare(CHAT, body, tokenizer, REJECT).max_tokens == 7


def test_chat_truncation_drops_the_oldest_history_and_keeps_system_and_question(tokenizer):
    messages = [{"role": "system", "content": words(10, "sys")},
                {"role": "user", "content": words(30, "old")},
                {"role": "assistant", "content": words(30, "reply")},
                {"role": "user", "content": words(20, "question")}]
    # 13 + 33 + 33 + 23 + 2 = 104 tokens; 80 may stay beside max_tokens 20.
    p = prepare(CHAT, {"messages": messages, "max_tokens": 20}, tokenizer, TRUNCATE)
    kept = [m["content"].split()[0] for m in p.body["messages"]]
    assert kept == ["sys", "reply", "question"]
    assert p.prompt_tokens == [71] and p.truncated_tokens == 33
    assert messages[1]["content"] == words(30, "old")  # the client's body is not mutated


def test_chat_truncation_cuts_a_single_long_question_from_the_left(tokenizer):
    messages = [{"role": "user", "content": " ".join(["x"] * 100 + ["yy"] * 10)}]
    p = prepare(CHAT, {"messages": messages, "max_tokens": 20}, tokenizer, TRUNCATE)
    assert p.prompt_tokens[0] <= 80
    assert p.body["messages"][0]["content"].endswith(" ".join(["ww"] * 10))


def test_chat_that_cannot_fit_even_without_history_is_rejected_with_counts(tokenizer):
    messages = [{"role": "system", "content": words(95)}, {"role": "user", "content": "hi"}]
    with pytest.raises(ContextTooLong, match="maximum context is 100 tokens"):
        prepare(CHAT, {"messages": messages, "max_tokens": 10}, tokenizer, TRUNCATE)


@pytest.mark.parametrize(("route", "body", "message"), [
    (COMPLETIONS, {"prompt": 5}, "prompt (or input) must be a string"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens must be a positive integer"),
    (COMPLETIONS, {"prompt": "x", "n": "2"}, "n must be a positive integer"),
    (CHAT, {"messages": []}, "messages must be a non-empty list"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0] must be an object with a role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    (COMPLETIONS, ["not", "an", "object"], "must be a JSON object"),
])
def test_malformed_bodies_are_invalid_requests(tokenizer, route, body, message):
    with pytest.raises(InvalidRequest) as e:
        prepare(route, body, tokenizer, REJECT)
    assert message in str(e.value)


def test_embeddings_cost_their_input_and_are_cut_or_refused_alone(tokenizer):
    from gpufleet_engine.context import EMBEDDINGS

    p = prepare(EMBEDDINGS, {"input": [words(40), words(10)]}, tokenizer, REJECT)
    assert p.prompt_tokens == [40, 10] and p.max_tokens == 0 and p.block_cost(32) == 2 + 1
    with pytest.raises(ContextTooLong, match="has 120 prompt tokens"):
        prepare(EMBEDDINGS, {"input": words(120)}, tokenizer, REJECT)
    cut = prepare(EMBEDDINGS, {"input": words(120)}, tokenizer, TRUNCATE)
    assert cut.body["input"] == [1] * 100 and cut.truncated_tokens == 20
