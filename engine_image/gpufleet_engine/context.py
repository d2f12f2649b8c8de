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

from .admission import block_cost
from .tokens import Tokenizer, keep_last, truncate_text_left

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"

# Request fields that change how vLLM renders a chat; passed to the template
# so the count matches.
_TEMPLATE_FIELDS = ("tools", "documents")


class InvalidRequest(ValueError):
    """The body is not a request the guard can count; answered with 400."""


class ContextTooLong(ValueError):
    """prompt + max_tokens exceed the context limit and the policy is Reject."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit
        super().__init__(
            f"This request has {prompt_tokens} prompt tokens and asks for {max_tokens} completion "
            f"tokens, {prompt_tokens + max_tokens} in total, but the maximum context is {limit} "
            f"tokens. Shorten the prompt or lower max_tokens.")


@dataclass(frozen=True)
class Limits:
    max_context_tokens: int
    truncate_left: bool


@dataclass
class Prepared:
    body: dict[str, Any]                 # what is forwarded to vLLM
    prompt_tokens: list[int]             # per prompt, after truncation
    max_tokens: int
    sequences_per_prompt: int            # n (or best_of)
    stream: bool
    truncated_tokens: int = 0
    changed: bool = field(default=False)  # body differs from what the client sent

    def block_cost(self, block_size: int) -> int:
        return sum(block_cost(p, self.max_tokens, block_size, self.sequences_per_prompt)
                   for p in self.prompt_tokens)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)


def prepare(route: str, body: Any, tokenizer: Tokenizer, limits: Limits) -> Prepared:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    max_key, requested = _max_tokens(route, body)
    sequences = _sequences(body)
    stream = bool(body.get("stream", False))
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
            raise InvalidRequest(f"{key} must be a positive integer, got {value!r}")
        return key, value
    return "max_tokens", None


def _sequences(body: dict) -> int:
    counts = []
    for key in ("n", "best_of"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequest(f"{key} must be a positive integer, got {value!r}")
        counts.append(value)
    return max(counts, default=1)


def _budget(prompt: int, requested: int | None, limits: Limits) -> tuple[int, int]:
    """(prompt tokens to keep, max_tokens) under the limit, or raise ContextTooLong.

    Without max_tokens vLLM generates until the context is full, so the
    budget is what the prompt leaves; when the prompt alone fills the context
    TruncateLeft leaves one token for the answer.
    """
    limit = limits.max_context_tokens
    if requested is None:
        if prompt < limit:
            return prompt, limit - prompt
        if not limits.truncate_left:
            raise ContextTooLong(prompt, 0, limit)
        return limit - 1, 1
    if prompt + requested <= limit:
        return prompt, requested
    if not limits.truncate_left or requested >= limit:
        raise ContextTooLong(prompt, requested, limit)
    return limit - requested, requested


def _prepare_completions(body, tokenizer, limits, max_key, requested, sequences, stream) -> Prepared:
    prompts = _completion_prompts(body.get("prompt"))
    out_prompts: list[str | list[int]] = []
    counts: list[int] = []
    budgets: list[int] = []
    truncated = 0
    changed = False
    for prompt in prompts:
        ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
        keep, budget = _budget(len(ids), requested, limits)
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
    # One max_tokens applies to every prompt of a batch; the tightest one rules.
    max_tokens = min(budgets)
    forwarded = body
    if changed or requested is None:
        forwarded = dict(body)
        if changed:
            forwarded["prompt"] = out_prompts if _is_batch(body.get("prompt")) else out_prompts[0]
        if requested is None:
            forwarded[max_key] = max_tokens
            changed = True
    return Prepared(forwarded, counts, max_tokens, sequences, stream, truncated, changed)


def _prepare_embeddings(body, tokenizer, limits) -> Prepared:
    """Embeddings only prefill: the cost is the input's blocks, the limit applies to the input alone."""
    inputs = _completion_prompts(body.get("input"))
    out: list[str | list[int]] = []
    counts: list[int] = []
    truncated = 0
    for item in inputs:
        ids = list(item) if isinstance(item, list) else tokenizer.encode(item)
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
    return Prepared(forwarded, counts, 0, 1, False, truncated, bool(truncated))


def _is_batch(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequest("prompt (or input) must be a string, a list of strings, a list of token ids "
                         "or a list of lists of token ids")


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
        raise InvalidRequest("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequest(f"messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported "
                                         f"by this model's guard")
                texts.append(str(part.get("text", "")))
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


def _prepare_chat(body, tokenizer, limits, max_key, requested, sequences, stream) -> Prepared:
    messages = _text_messages(body.get("messages"))
    kwargs = _template_kwargs(body)
    count = len(tokenizer.chat_ids(messages, kwargs))
    keep, budget = _budget(count, requested, limits)
    truncated_from = count
    changed = False
    if keep < count:
        messages = _truncate_chat(messages, kwargs, tokenizer, keep, budget, limits.max_context_tokens)
        count = len(tokenizer.chat_ids(messages, kwargs))
        changed = True
    forwarded = body
    if changed or requested is None:
        forwarded = dict(body)
        if changed:
            forwarded["messages"] = messages
        if requested is None:
            forwarded[max_key] = budget
            changed = True
    return Prepared(forwarded, [count], budget, sequences, stream,
                    truncated_from - count if truncated_from > count else 0, changed)


def _truncate_chat(messages: list[dict], kwargs: dict, tokenizer: Tokenizer, keep: int,
                   max_tokens: int, limit: int) -> list[dict]:
    """Drop the oldest non-system messages, then cut the oldest remaining text, until ``keep`` fits.

    System messages carry the instructions and the last message carries the
    question; history in between goes first.
    """
    messages = copy.deepcopy(messages)

    def size(ms: list[dict]) -> int:
        return len(tokenizer.chat_ids(ms, kwargs))

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
