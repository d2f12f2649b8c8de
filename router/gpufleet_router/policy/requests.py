"""What the router reads from an OpenAI request body, and the errors it answers (pure).

The router reads only what routing needs: ``model`` (which service), the
prompt's text (its prefix picks a replica; its length estimates the KV
blocks the request will take) and ``max_tokens``. Everything else passes
through to the guard untouched, which checks the rest."""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from gpufleet_api import bounded_json

from ..errors import RouterError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
ROUTES = (CHAT, COMPLETIONS, EMBEDDINGS)

# A rough bytes-per-token for English text (the router does not tokenize):
# only the replica choice uses it, and the guard's next reading corrects it.
CHARS_PER_TOKEN = 4
# Output assumed for a request that names no max_tokens (answers end at EOS long before the context does).
DEFAULT_OUTPUT_TOKENS = 256


class BadRequest(RouterError):
    """A request the router refuses itself: answered in the OpenAI error format."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Parsed:
    model: str
    prompt: str          # the prompt's text as the prefix cache would see its start
    max_tokens: int | None
    stream: bool
    # The body as parsed, for the router's tokenizer (prompt_tokens.py); not part of the request's identity.
    doc: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def cost_blocks(self, block_size: int, route: str, prompt_tokens: int | None = None) -> int:
        """KV blocks the request will hold at most, estimated from characters (``prompt_tokens``: counted)."""
        return max(1, math.ceil(self.estimated_tokens(route, prompt_tokens) / max(1, block_size)))

    def estimated_tokens(self, route: str, prompt_tokens: int | None = None) -> int:
        """The prompt's tokens estimated from characters (or ``prompt_tokens`` where the router tokenized it),
        plus the answer's limit (``max_tokens`` or ``max_completion_tokens``; DEFAULT_OUTPUT_TOKENS where it
        names none). Embeddings have no answer. What a tenant's tokens-per-minute budget is charged at
        admission, until the real count."""
        tokens = prompt_tokens if prompt_tokens is not None else math.ceil(len(self.prompt) / CHARS_PER_TOKEN)
        if route != EMBEDDINGS:
            tokens += self.max_tokens if self.max_tokens is not None else DEFAULT_OUTPUT_TOKENS
        return tokens


def parse(body: bytes, route: str) -> Parsed:
    try:
        doc = bounded_json.loads(body)
    except bounded_json.TooDeep as e:
        raise BadRequest(400, f"The request body is not accepted: {e}.", code="json_too_deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(400, f"The request body is not valid JSON: {e}. Send a JSON object such as "
                              f'{{"model": "...", ...}} with Content-Type: application/json.') from None
    if not isinstance(doc, dict):
        raise BadRequest(400, f"The request body must be a JSON object, not {type(doc).__name__}.")
    model = doc.get("model")
    if model is None:
        raise BadRequest(400, "The request has no `model`: name the model to use (GET /v1/models lists them).",
                         param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, f"`model` must be a non-empty string, not {json.dumps(model)[:80]}.",
                         param="model")
    max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)):
        raise BadRequest(400, f"`max_tokens` must be an integer, not {json.dumps(max_tokens)[:80]}.",
                         param="max_tokens")
    return Parsed(model=model, prompt=prompt_text(doc, route), max_tokens=max_tokens,
                  stream=doc.get("stream") is True, doc=doc)


def prompt_text(doc: dict, route: str) -> str:
    """The prompt flattened to text in order (chat: role and content of each message)."""
    if route == CHAT:
        parts = []
        for message in doc.get("messages") or []:
            if isinstance(message, dict):
                parts.append(f"{message.get('role', '')}\n{_text(message.get('content'))}\n")
        return "".join(parts)
    return _text(doc.get("prompt") if route == COMPLETIONS else doc.get("input"))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):  # token ids: about one token each
            return " ".join(str(v) for v in value)
        return "".join(_text(v.get("text") if isinstance(v, dict) else v) for v in value)
    return ""
