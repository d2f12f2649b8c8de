"""An OpenAI request body → what it costs, with the context limit enforced.

Pure apart from the tokenizer it is handed. Over-long requests are refused
(``Reject``) or cut from the left (``TruncateLeft``) here, before vLLM sees
them, so a client learns the real token counts instead of a late engine error.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from gpufleet_engine.admission.kv_ledger import block_cost
from gpufleet_engine.admission.tokens import Tokenizer, keep_last, truncate_text_left
from gpufleet_engine.errors import GuardError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"

# Request fields that change how vLLM renders a chat; passed to the template
# so the count matches.
_TEMPLATE_FIELDS = ("tools", "documents")


class InvalidRequest(GuardError, ValueError):
    """The body is not a request the guard (or vLLM) would accept; answered with 400.

    ``param`` names the offending field, as vLLM's own 400s do."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextTooLong(GuardError, ValueError):
    """prompt + max_tokens exceed the context limit and the policy is Reject."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit
        super().__init__(
            f"This request has {prompt_tokens} prompt tokens and asks for {max_tokens} completion "
            f"tokens, {prompt_tokens + max_tokens} in total, but the maximum context is {limit} "
            f"tokens. Shorten the prompt or lower max_tokens.")


# vLLM's own limits (VLLM_MAX_N_SEQUENCES, VLLM_MAX_COMPLETION_PROMPTS defaults):
# beyond them vLLM answers 400, so the guard does too, before tokenizing.
MAX_SEQUENCES = 16384
MAX_PROMPTS = 1024
# What vLLM generates for /v1/completions without max_tokens (its protocol's
# default, as in the OpenAI API). Chat has none: the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Limits:
    max_context_tokens: int
    truncate_left: bool
    # vLLM's context length; a request without max_tokens may use all of it
    # there. None: the same as max_context_tokens.
    max_model_len: int | None = None
    # The model's generation_config.json max_new_tokens, which vLLM uses for
    # a chat without max_tokens; None when the model sets none.
    default_max_tokens: int | None = None


@dataclass
class Prepared:
    body: dict[str, Any]                 # what is forwarded to vLLM
    prompt_tokens: list[int]             # per prompt, after truncation
    budgets: list[int]                   # per prompt: the most output tokens vLLM will generate per sequence
    sequences_per_prompt: int            # n (or best_of)
    stream: bool
    truncated_tokens: int = 0
    changed: bool = field(default=False)  # body differs from what the client sent
    # Its part in a prefill/decode hand-off (kv_handoff.Phase): whole, prefill or decode.
    phase: str = "whole"
    # The LoRA adapter it asks for (its ``model``, loaded on this replica); None: the base model.
    adapter: str | None = None

    @property
    def max_tokens(self) -> int:
        return max(self.budgets, default=0)

    def block_cost(self, block_size: int, output_tokens: int | None = None) -> int:
        """Blocks for every prompt and sequence, each with ``output_tokens`` (capped at its budget;
        None: the whole budget)."""
        return sum(block_cost(p, b if output_tokens is None else min(b, output_tokens), block_size,
                              self.sequences_per_prompt)
                   for p, b in zip(self.prompt_tokens, self.budgets, strict=True))

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)


def prepare(route: str, body: Any, tokenizer: Tokenizer, limits: Limits) -> Prepared:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    max_key, requested = _max_tokens(route, body)
    sequences = _sequences(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", "stream")
    if route == CHAT:
        return _prepare_chat(body, tokenizer, limits, max_key, requested, sequences, stream)
    if route == COMPLETIONS:
        return _prepare_completions(body, tokenizer, limits, max_key, requested, sequences, stream)
    if route == EMBEDDINGS:
        return _prepare_embeddings(body, tokenizer, limits)
    raise InvalidRequest(f"the guard does not admit requests for {route}")


def _max_tokens(route: str, body: dict) -> tuple[str, int | None]:
    keys = ("max_completion_tokens", "max_tokens") if route == CHAT else ("max_tokens",)
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequest(f"{key} must be a positive integer, got {value!r}", key)
        return key, value
    return "max_tokens", None


def _sequences(body: dict) -> int:
    counts = []
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SEQUENCES:
            raise InvalidRequest(f"{key} must be an integer from 1 to {MAX_SEQUENCES}, got {value!r}", key)
        counts.append(value)
    n, best_of = body.get("n"), body.get("best_of")
    if n is not None and best_of is not None and best_of < n:
        raise InvalidRequest(f"best_of must be at least n, got best_of={best_of} and n={n}", "best_of")
    return max(counts, default=1)


def _default_budget(route: str, body: dict, prompt: int, limits: Limits) -> int:
    """What vLLM generates per sequence for a request without max_tokens: its own default for
    the route, never more than its context leaves (vLLM's get_max_tokens)."""
    model_len = limits.max_model_len or limits.max_context_tokens
    room = max(0, model_len - prompt)
    if route == COMPLETIONS and "max_tokens" not in body:
        return min(room, COMPLETIONS_DEFAULT_MAX_TOKENS)
    if limits.default_max_tokens is not None:
        return min(room, limits.default_max_tokens)
    return room


def _budget(prompt: int, requested: int | None, default: int, limits: Limits) -> tuple[int, int, bool]:
    """(prompt tokens to keep, max_tokens per sequence, whether max_tokens must be sent) under the
    limit, or raise ContextTooLong.

    Without max_tokens the budget is vLLM's own ``default`` and the body is
    forwarded as sent, so the answer is the one vLLM gives directly. Only
    where that default would pass the guard's limit (maxContextTokens below
    the engine's context) does the guard send max_tokens; when the prompt
    alone fills the context TruncateLeft leaves one token for the answer.
    """
    limit = limits.max_context_tokens
    if requested is None:
        if prompt < limit:
            budget = min(default, limit - prompt)
            if budget >= 1:
                return prompt, budget, budget < default
        if not limits.truncate_left or prompt < limit:
            raise ContextTooLong(prompt, 0, limit)
        return limit - 1, 1, True
    if prompt + requested <= limit:
        return prompt, requested, False
    if not limits.truncate_left or requested >= limit:
        raise ContextTooLong(prompt, requested, limit)
    return limit - requested, requested, False


def _prepare_completions(body, tokenizer, limits, max_key, requested, sequences, stream) -> Prepared:
    prompts = _completion_prompts(body.get("prompt"))
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"a batch may hold at most {MAX_PROMPTS} prompts, got {len(prompts)}", "prompt")
    out_prompts: list[str | list[int]] = []
    counts: list[int] = []
    budgets: list[int] = []
    truncated = 0
    changed = False
    fill = False
    for prompt in prompts:
        ids = list(prompt) if isinstance(prompt, list) else _encode(tokenizer, prompt)
        default = _default_budget(COMPLETIONS, body, len(ids), limits)
        keep, budget, must_send = _budget(len(ids), requested, default, limits)
        fill = fill or must_send
        if keep < len(ids):
            # Forward token ids, not re-decoded text: decode→encode may not
            # round-trip to the same count.
            out_prompts.append(keep_last(ids, keep))
            truncated += len(ids) - keep
            changed = True
        else:
            out_prompts.append(prompt)
        counts.append(keep)
        budgets.append(budget)
    forwarded = body
    if changed or fill:
        forwarded = dict(body)
        if changed:
            forwarded["prompt"] = out_prompts if _is_batch(body.get("prompt")) else out_prompts[0]
        if fill:
            # One max_tokens applies to every prompt of a batch; the tightest one rules.
            budgets = [min(budgets)] * len(budgets)
            forwarded[max_key] = budgets[0]
            changed = True
    return Prepared(forwarded, counts, budgets, sequences, stream, truncated, changed)


def _prepare_embeddings(body, tokenizer, limits) -> Prepared:
    """Embeddings only prefill: the cost is the input's blocks, the limit applies to the input alone."""
    inputs = _completion_prompts(body.get("input"))
    if len(inputs) > MAX_PROMPTS:
        raise InvalidRequest(f"a batch may hold at most {MAX_PROMPTS} inputs, got {len(inputs)}", "input")
    out: list[str | list[int]] = []
    counts: list[int] = []
    truncated = 0
    for item in inputs:
        ids = list(item) if isinstance(item, list) else _encode(tokenizer, item)
        if len(ids) > limits.max_context_tokens:
            if not limits.truncate_left:
                raise ContextTooLong(len(ids), 0, limits.max_context_tokens)
            truncated += len(ids) - limits.max_context_tokens
            ids = keep_last(ids, limits.max_context_tokens)
            out.append(ids)
        else:
            out.append(item)
        counts.append(len(ids))
    forwarded = body
    if truncated:
        forwarded = {**body, "input": out if _is_batch(body.get("input")) else out[0]}
    return Prepared(forwarded, counts, [0] * len(counts), 1, False, truncated, bool(truncated))


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _token_ids(items: list) -> bool:
    """Whether every item is an int (JSON's true and false are not): the types are collected in
    C, not checked one by one in Python, since a prompt may hold a whole context of ids."""
    return set(map(type, items)) == {int}


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _token_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and _token_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequest("prompt (or input) must be a string, a list of strings, a list of token ids "
                         "or a list of lists of token ids", "prompt")


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as e:  # noqa: BLE001 — whatever the tokenizer refuses is the input's fault
        raise InvalidRequest(f"the model's tokenizer cannot encode this prompt: {e}", "prompt") from e


def _chat_count(tokenizer: Tokenizer, messages: list[dict], kwargs: dict) -> int:
    try:
        return len(tokenizer.chat_ids(messages, kwargs))
    except Exception as e:  # noqa: BLE001 — template errors (roles that do not alternate, …) are 400s
        raise InvalidRequest(f"the model's chat template cannot render these messages: {e}",
                             "messages") from e


def _template_kwargs(body: dict) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"add_generation_prompt": body.get("add_generation_prompt", True)}
    if body.get("continue_final_message"):
        kwargs["continue_final_message"] = True
        kwargs["add_generation_prompt"] = False
    for key in _TEMPLATE_FIELDS:
        if body.get(key) is not None:
            kwargs[key] = body[key]
    extra = body.get("chat_template_kwargs")
    if isinstance(extra, dict):
        kwargs.update(extra)
    return kwargs


def _text_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with text-part lists flattened to strings, as vLLM does for string templates."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported "
                                         f"by this model's guard", "messages")
                texts.append(str(part.get("text", "")))
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


def _prepare_chat(body, tokenizer, limits, max_key, requested, sequences, stream) -> Prepared:
    messages = _text_messages(body.get("messages"))
    kwargs = _template_kwargs(body)
    count = _chat_count(tokenizer, messages, kwargs)
    keep, budget, fill = _budget(count, requested, _default_budget(CHAT, body, count, limits), limits)
    truncated_from = count
    changed = False
    if keep < count:
        messages = _truncate_chat(messages, kwargs, tokenizer, keep, budget, limits.max_context_tokens)
        count = _chat_count(tokenizer, messages, kwargs)
        changed = True
    forwarded = body
    if changed or fill:
        forwarded = dict(body)
        if changed:
            forwarded["messages"] = messages
        if fill:
            forwarded[max_key] = budget
            changed = True
    return Prepared(forwarded, [count], [budget], sequences, stream,
                    truncated_from - count if truncated_from > count else 0, changed)


def _truncate_chat(messages: list[dict], kwargs: dict, tokenizer: Tokenizer, keep: int,
                   max_tokens: int, limit: int) -> list[dict]:
    """Drop the oldest non-system messages, then cut the oldest remaining text, until ``keep`` fits.

    System messages carry the instructions and the last message carries the
    question; history in between goes first.
    """
    messages = copy.deepcopy(messages)

    def size(ms: list[dict]) -> int:
        return _chat_count(tokenizer, ms, kwargs)

    while size(messages) > keep:
        droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
        if not droppable:
            break
        del messages[droppable[0]]
    # Cut text from the left of the oldest non-system message left. Token
    # counts of a standalone string and of the same string inside the
    # template differ by a few tokens, so repeat until it fits.
    for _ in range(8):
        over = size(messages) - keep
        if over <= 0:
            return messages
        target = next((m for m in messages if m.get("role") != "system"
                       and isinstance(m.get("content"), str) and m["content"]), None)
        if target is None:
            break
        target["content"] = truncate_text_left(tokenizer, target["content"], over + math.ceil(over / 50) + 1)
    if size(messages) > keep:
        # What is left is system instructions (or non-text content) alone.
        raise ContextTooLong(size(messages), max_tokens, limit)
    return messages
