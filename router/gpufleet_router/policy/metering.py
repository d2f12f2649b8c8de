"""The tokens an answer used, as its client was told them in ``usage`` (pure): what a tenant's
usage counters and its tokens-per-minute budget are charged.

A streamed completion's usage is read by its relay (resume.Stream: vLLM's usage of every chunk, the router
asks for it upstream); a JSON answer's from its ``usage``, the answer held for that while it goes to the
client, at most ``MAX_USAGE_BODY_BYTES`` (a longer answer, such as a large batch of embeddings, is left
uncounted: its estimate stands)."""
from __future__ import annotations

import dataclasses
from typing import Any, TypeGuard

from gpufleet_api import bounded_json
from gpufleet_api.guard.guard_metrics import REASONS

# The reason a guard's refusal is counted under when its code is none of the guard's (REASONS): the label
# stays bounded whatever a replica answers.
OTHER_REFUSAL = "other"

MAX_USAGE_BODY_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Counted:
    prompt: int
    answer: int
    cached: int = 0      # of the prompt's, found in the prefix cache (vLLM's prompt_tokens_details)

    @property
    def total(self) -> int:
        return self.prompt + self.answer


def cached_tokens(usage: dict) -> int:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if _count(cached) else 0


def from_usage(usage: Any) -> Counted | None:
    """An OpenAI ``usage`` object's counts; None where it is not one."""
    if not isinstance(usage, dict):
        return None
    prompt, answer = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    if not (_count(prompt) and _count(answer)):
        return None
    return Counted(prompt, answer, cached_tokens(usage))


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class BodyTap:
    """A JSON answer's bytes as they pass to the client, held up to MAX_USAGE_BODY_BYTES to read its usage."""

    def __init__(self, limit: int = MAX_USAGE_BODY_BYTES):
        self.limit = limit
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        if self._size <= self.limit:
            self._size += len(chunk)
            self._chunks.append(chunk)

    def counted(self) -> Counted | None:
        """The usage of the whole answer; None when it had none, was no JSON object, or was too long."""
        if self._size > self.limit:
            return None
        try:
            doc = bounded_json.loads(b"".join(self._chunks))
        except ValueError:
            return None
        return from_usage(doc.get("usage")) if isinstance(doc, dict) else None


def refusal_reason(body: bytes) -> str:
    """A guard's refusal's reason code (its error ``code``), or OTHER_REFUSAL."""
    try:
        code = (bounded_json.loads(body).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return OTHER_REFUSAL
    return code if isinstance(code, str) and code in REASONS else OTHER_REFUSAL
