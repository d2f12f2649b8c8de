"""Context limits before vLLM: counts, Reject, TruncateLeft."""
from __future__ import annotations

import pytest

from gpufleet_engine.admission.context import CHAT, COMPLETIONS, ContextTooLong, InvalidRequest, Limits, prepare

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


def test_without_max_tokens_completions_get_vllms_default_of_16_and_the_body_is_untouched(tokenizer):
    body = {"prompt": words(30)}
    p = prepare(COMPLETIONS, body, tokenizer, REJECT)
    assert p.max_tokens == 16 and p.body is body and not p.changed and p.block_cost(32) == 2
    near_the_end = prepare(COMPLETIONS, {"prompt": words(90)}, tokenizer, REJECT)
    assert near_the_end.max_tokens == 10 and "max_tokens" not in near_the_end.body


def test_completions_with_an_explicit_null_max_tokens_may_use_the_rest_of_the_context(tokenizer):
    p = prepare(COMPLETIONS, {"prompt": words(30), "max_tokens": None}, tokenizer, REJECT)
    assert p.max_tokens == 70 and p.body["max_tokens"] is None and not p.changed


def test_without_max_tokens_chat_may_use_the_rest_of_the_context_and_the_body_is_untouched(tokenizer):
    body = {"messages": [{"role": "user", "content": words(10)}]}
    p = prepare(CHAT, body, tokenizer, REJECT)
    assert p.prompt_tokens == [15] and p.max_tokens == 85 and p.body is body


def test_the_models_generation_default_bounds_a_chat_without_max_tokens(tokenizer):
    limits = Limits(100, truncate_left=False, default_max_tokens=20)
    p = prepare(CHAT, {"messages": [{"role": "user", "content": words(10)}]}, tokenizer, limits)
    assert p.max_tokens == 20 and "max_tokens" not in p.body


def test_a_context_limit_below_the_engines_is_made_explicit_only_where_vllm_would_pass_it(tokenizer):
    limits = Limits(100, truncate_left=False, max_model_len=400)
    chat = prepare(CHAT, {"messages": [{"role": "user", "content": words(10)}]}, tokenizer, limits)
    assert chat.max_tokens == 85 and chat.body["max_tokens"] == 85 and chat.changed
    completion = prepare(COMPLETIONS, {"prompt": words(30)}, tokenizer, limits)
    assert completion.max_tokens == 16 and "max_tokens" not in completion.body


def test_without_max_tokens_a_full_prompt_is_rejected_or_cut_to_leave_one_token(tokenizer):
    with pytest.raises(ContextTooLong, match="has 120 prompt tokens"):
        prepare(COMPLETIONS, {"prompt": words(120)}, tokenizer, REJECT)
    p = prepare(COMPLETIONS, {"prompt": words(120)}, tokenizer, TRUNCATE)
    assert p.prompt_tokens == [99] and p.max_tokens == 1 and p.body["max_tokens"] == 1


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
    (COMPLETIONS, {"prompt": "x", "max_tokens": -3}, "max_tokens must be a positive integer"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "9"}, "max_tokens must be a positive integer"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens must be a positive integer"),
    (COMPLETIONS, {"prompt": "x", "n": "2"}, "n must be an integer from 1 to 16384"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n must be an integer from 1 to 16384"),
    (COMPLETIONS, {"prompt": "x", "n": 20000}, "n must be an integer from 1 to 16384"),
    (COMPLETIONS, {"prompt": "x", "n": 3, "best_of": 2}, "best_of must be at least n"),
    (COMPLETIONS, {"prompt": ["x"] * 1025}, "at most 1024 prompts"),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream must be true or false"),
    (CHAT, {"messages": "hello"}, "messages must be a non-empty list"),
    (CHAT, {"messages": []}, "messages must be a non-empty list"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0] must be an object with a role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    (COMPLETIONS, ["not", "an", "object"], "must be a JSON object"),
    (COMPLETIONS, {"prompt": [1, 2, True]}, "list of token ids"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, False]]}, "list of lists of token ids"),
    (COMPLETIONS, {"prompt": [[1, 2], [3, 4.0]]}, "list of lists of token ids"),
])
def test_malformed_bodies_are_invalid_requests(tokenizer, route, body, message):
    with pytest.raises(InvalidRequest) as e:
        prepare(route, body, tokenizer, REJECT)
    assert message in str(e.value)


def test_embeddings_cost_their_input_and_are_cut_or_refused_alone(tokenizer):
    from gpufleet_engine.admission.context import EMBEDDINGS

    p = prepare(EMBEDDINGS, {"input": [words(40), words(10)]}, tokenizer, REJECT)
    assert p.prompt_tokens == [40, 10] and p.max_tokens == 0 and p.block_cost(32) == 2 + 1
    with pytest.raises(ContextTooLong, match="has 120 prompt tokens"):
        prepare(EMBEDDINGS, {"input": words(120)}, tokenizer, REJECT)
    cut = prepare(EMBEDDINGS, {"input": words(120)}, tokenizer, TRUNCATE)
    assert cut.body["input"] == [1] * 100 and cut.truncated_tokens == 20


class _StrictTemplate:
    """A tokenizer whose chat template raises, as Llama's and Mistral's do on roles that do not alternate."""

    def encode(self, text):
        raise UnicodeError("cannot encode")

    def decode(self, ids):
        return ""

    def chat_ids(self, messages, template_kwargs):
        raise RuntimeError("Conversation roles must alternate user/assistant/user/assistant/...")


def test_tokenizer_and_chat_template_failures_are_invalid_requests_naming_the_cause():
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequest, match="roles must alternate") as e:
        prepare(CHAT, {"messages": two_users}, _StrictTemplate(), REJECT)
    assert e.value.param == "messages"
    with pytest.raises(InvalidRequest, match="tokenizer cannot encode"):
        prepare(COMPLETIONS, {"prompt": "x"}, _StrictTemplate(), REJECT)


def test_the_reservation_can_be_less_than_the_budget():
    p = prepare(COMPLETIONS, {"prompt": list(range(100)), "max_tokens": 1000, "n": 2}, None, REJECT_BIG)
    assert p.block_cost(32) == 2 * 35 and p.block_cost(32, output_tokens=60) == 2 * 5
    assert p.block_cost(32, output_tokens=5000) == p.block_cost(32)


REJECT_BIG = Limits(4096, truncate_left=False)
