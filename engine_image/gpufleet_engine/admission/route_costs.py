"""What a request on any admitted vLLM route costs: its body → ``context.Prepared``.

The OpenAI routes (chat, completions, embeddings) keep their own models in
``context`` (truncation included). The other routes vLLM serves are counted
here and forwarded unchanged: over-long ones are refused (400), never cut,
because the guard does not rewrite bodies it has no model of. Pure apart from
the tokenizer; the route each path gets is in ``vllm_routes``.
"""
from __future__ import annotations

from typing import Any

from gpufleet_engine.admission import context, kv_handoff
from gpufleet_engine.admission.context import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    ContextTooLong,
    InvalidRequest,
    Limits,
    Prepared,
)
from gpufleet_engine.admission.tokens import Tokenizer

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
INVOCATIONS = "/invocations"
TOKENS_GENERATE = "/inference/v1/generate"
PREFILL = ("/pooling", "/classify", "/v2/embed")
PAIRS = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
# Fields that hold the inputs of the prefill-only routes, and the two sides of a scoring pair.
_PREFILL_FIELDS = ("input", "texts", "inputs", "prompt")
_LEFT = ("query", "queries", "text_1", "data_1")
_RIGHT = ("documents", "items", "text_2", "data_2")


def prepare(path: str, body: Any, tokenizer: Tokenizer, limits: Limits) -> Prepared:
    """The cost of ``body`` sent to ``path``; InvalidRequest or ContextTooLong when it cannot be admitted."""
    prepared = _prepare(path, body, tokenizer, limits)
    if prepared.max_tokens:
        # Generation only: a prefill/decode hand-off changes what it holds and computes (kv_handoff.py).
        prepared.phase = kv_handoff.phase_of(body)
    return prepared


def _prepare(path: str, body: Any, tokenizer: Tokenizer, limits: Limits) -> Prepared:
    if path in (CHAT, COMPLETIONS, EMBEDDINGS):
        return context.prepare(path, body, tokenizer, limits)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if path == INVOCATIONS:
        # SageMaker's one route: vLLM picks the API by the body's shape, and so does the guard.
        kind = CHAT if "messages" in body else COMPLETIONS if "prompt" in body else EMBEDDINGS
        return context.prepare(kind, body, tokenizer, limits)
    stream = _stream(body)
    if path == RESPONSES:
        messages = _responses_messages(body)
        return _chat_like(body, messages, _max("max_output_tokens", body), tokenizer, limits, stream)
    if path == MESSAGES:
        return _chat_like(body, _anthropic_messages(body), _max("max_tokens", body), tokenizer, limits, stream)
    if path == TOKENS_GENERATE:
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise InvalidRequest("token_ids must be a non-empty list of token ids", "token_ids")
        params = body.get("sampling_params") or {}
        requested = _max("max_tokens", params) if isinstance(params, dict) else None
        return _generation([len(ids)], requested, limits, stream, body)
    if path in PREFILL:
        return _prefill(body, [_count(tokenizer, t) for f in _PREFILL_FIELDS for t in _texts(body.get(f))]
                        + _message_counts(body, tokenizer), limits)
    if path in PAIRS:
        return _prefill(body, _pair_counts(body, tokenizer), limits)
    # Any other generation route: every text in the body as prompt, max_tokens else the rest of the context.
    prompt = sum(_count(tokenizer, t) for t in _texts(body))
    return _generation([prompt], _max("max_tokens", body) or _max("max_completion_tokens", body),
                       limits, stream, body)


def _stream(body: dict) -> bool:
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", "stream")
    return stream


def _max(key: str, body: dict) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{key} must be a positive integer, got {value!r}", key)
    return value


def _fit(prompt: int, requested: int | None, limits: Limits, default: int | None = None) -> int:
    """Output tokens to reserve for ``prompt``: ``requested``, else what vLLM would generate
    (the model's default, at most the rest of the context)."""
    limit = limits.max_context_tokens
    if requested is not None:
        if prompt + requested > limit:
            raise ContextTooLong(prompt, requested, limit)
        return requested
    room = min(limit, limits.max_model_len or limit) - prompt
    budget = room if default is None else min(room, default)
    if budget < 1:
        raise ContextTooLong(prompt, 0, limit)
    return budget


def _generation(prompts: list[int], requested: int | None, limits: Limits, stream: bool,
                body: dict, default: int | None = None) -> Prepared:
    budgets = [_fit(p, requested, limits, default) for p in prompts]
    return Prepared(body, prompts, budgets, 1, stream)


def _prefill(body: dict, counts: list[int], limits: Limits) -> Prepared:
    if not counts:
        raise InvalidRequest("the request has no input to score, embed or classify", "input")
    if len(counts) > context.MAX_PROMPTS:
        raise InvalidRequest(f"a batch may hold at most {context.MAX_PROMPTS} inputs, got {len(counts)}", "input")
    for count in counts:
        if count > limits.max_context_tokens:
            raise ContextTooLong(count, 0, limits.max_context_tokens)
    return Prepared(body, counts, [0] * len(counts), 1, False)


def _texts(value: Any) -> list[str | list[int]]:
    """Every text (or list of token ids) in a JSON value, in order: strings, ``text`` parts, nested lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return [value]
        return [t for item in value for t in _texts(item)]
    if isinstance(value, dict):
        return [t for key, item in value.items() if key not in ("model", "role", "type") for t in _texts(item)]
    return []


def _count(tokenizer: Tokenizer, text: str | list[int]) -> int:
    if isinstance(text, list):
        return len(text)
    try:
        return len(tokenizer.encode(text))
    except Exception as e:  # noqa: BLE001 — whatever the tokenizer refuses is the input's fault
        raise InvalidRequest(f"the model's tokenizer cannot encode this input: {e}", "input") from e


def _message_counts(body: dict, tokenizer: Tokenizer) -> list[int]:
    """Pooling and classification of a chat (``messages``): its template's token count."""
    if body.get("messages") is None:
        return []
    messages = _flatten(body["messages"], "messages")
    return [context._chat_count(tokenizer, messages, context._template_kwargs(body))]


def _pair_counts(body: dict, tokenizer: Tokenizer) -> list[int]:
    """Scoring and reranking: each query-document pair is one prompt of both sides' tokens."""
    left = next((body[k] for k in _LEFT if body.get(k) is not None), None)
    right = next((body[k] for k in _RIGHT if body.get(k) is not None), None)
    if left is None or right is None:
        raise InvalidRequest("a scoring request needs a query and documents (query/documents, "
                             "queries/items, text_1/text_2 or data_1/data_2)", "documents")
    lefts = [_count(tokenizer, t) for t in _items(left, tokenizer)]
    rights = [_count(tokenizer, t) for t in _items(right, tokenizer)]
    if len(lefts) == 1:
        return [lefts[0] + r for r in rights]
    if len(lefts) == len(rights):
        return [a + b for a, b in zip(lefts, rights)]
    return [max(lefts) + r for r in rights]


def _items(value: Any, tokenizer: Tokenizer) -> list[str]:
    """One scoring side as its items: each document (a string or an object of parts) one text."""
    items = value if isinstance(value, list) and not all(isinstance(t, int) for t in value) else [value]
    return [" ".join(t for t in _texts(item) if isinstance(t, str)) for item in items]


def _flatten(messages: Any, param: str) -> list[dict[str, Any]]:
    """Messages whose content may be a list of parts → role and text, as chat templates take them."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(f"{param} must be a non-empty list", param)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"{param}[{i}] must be an object", param)
        role = m.get("role") if isinstance(m.get("role"), str) else "user"
        content = m.get("content")
        text = content if isinstance(content, str) else "\n".join(
            t for t in _texts(content if content is not None else m) if isinstance(t, str))
        out.append({"role": role, "content": text})
    return out


def _chat_like(body: dict, messages: list[dict[str, Any]], requested: int | None, tokenizer: Tokenizer,
               limits: Limits, stream: bool) -> Prepared:
    prompt = context._chat_count(tokenizer, _merge_roles(messages), {"add_generation_prompt": True})
    return _generation([prompt], requested, limits, stream, body, limits.default_max_tokens)


def _merge_roles(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive messages of one role as one: chat templates that require alternating roles
    would refuse what vLLM's own conversion accepts."""
    merged: list[dict[str, Any]] = []
    for m in messages:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n" + m["content"]}
        else:
            merged.append(dict(m))
    return merged


def _responses_messages(body: dict) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    given = body.get("input")
    if isinstance(given, str):
        return system + [{"role": "user", "content": given}]
    if isinstance(given, list) and given:
        # Items that are not messages (function calls and their outputs) enter the prompt as their text.
        return system + _flatten(given, "input")
    raise InvalidRequest("input must be a string or a non-empty list of items", "input")


def _anthropic_messages(body: dict) -> list[dict[str, Any]]:
    system = body.get("system")
    head = ([{"role": "system", "content": "\n".join(t for t in _texts(system) if isinstance(t, str))}]
            if system else [])
    return head + _flatten(body.get("messages"), "messages")
