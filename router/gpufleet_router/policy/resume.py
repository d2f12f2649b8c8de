"""Resuming a streamed answer on another replica when its replica dies mid-stream (pure; docs/resumption.md).

The router relays a streamed ``/v1/completions`` or ``/v1/chat/completions``
answer event by event through a ``Stream``, which remembers what reached the
client: the text, the tokens (from vLLM's continuous usage stats, which the
router asks for upstream), the answer's ``id``/``created``/``model`` and
whether it finished. When the upstream breaks before ``data: [DONE]``, the
router sends ``Stream.continuation()`` to another replica: the prompt plus the
text already sent (chat: an assistant message with it, continued with
``continue_final_message``), with the token limits less the tokens already
sent. The resumed answer's events reach the client as if they came from the
first replica: the same ``id``, ``created`` and ``model``, no second role
announcement, and ``usage`` counting the original prompt and every token of
the answer.

What cannot be continued faithfully is refused (``not_resumable``): then the
client's stream ends with an OpenAI-shaped error event and ``data: [DONE]``
(as vLLM ends a stream that failed), never a silent truncation.
"""
from __future__ import annotations

import copy
import json
from typing import Any

from gpufleet_api import bounded_json

from . import metering
from .requests import CHAT, COMPLETIONS, error_body

RESUMABLE_ROUTES = (CHAT, COMPLETIONS)
DONE = b"data: [DONE]\n\n"
# The longest event the relay holds while it waits for the event's end: vLLM's are a token's delta, a few KiB
# with logprobs. Longer is a broken upstream (or one answering on behalf of a tenant): the stream ends with
# an error event instead of a buffer that grows with whatever the replica sends.
MAX_EVENT_BYTES = 1 << 20
# Request fields whose answer depends on more than the text sent so far, or that the continuation cannot
# carry over: a resumed answer would differ from what the client asked for.
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
           "guided_whitespace_pattern", "structured_outputs", "structural_tag")


class Code:
    """The ``code`` of the error event that ends a stream that was not resumed."""
    NOT_RESUMABLE = "stream_not_resumable"   # the request's kind cannot be continued faithfully
    BROKEN = "stream_broken"                 # resumption was tried and failed, or is switched off
    EVENT_TOO_LONG = "stream_event_too_long"  # the replica sent an event over MAX_EVENT_BYTES


def not_resumable(doc: Any, route: str) -> str | None:
    """Why a streamed request cannot be continued faithfully on another replica; None when it can."""
    if route not in RESUMABLE_ROUTES:
        return f"{route} is not resumed"
    if not isinstance(doc, dict):
        return "the request body is not a JSON object"

    def set_(key: str) -> bool:
        value = doc.get(key)
        return value not in (None, False, 0, "", [], {})

    if isinstance(doc.get("n"), int) and doc["n"] > 1:
        return "n > 1 (several answers in one stream)"
    if isinstance(doc.get("best_of"), int) and doc["best_of"] > 1:
        return "best_of > 1"
    if set_("use_beam_search"):
        return "beam search"
    if set_("echo"):
        return "echo (the prompt is part of the answer)"
    if route == COMPLETIONS and doc.get("logprobs") is not None or set_("logprobs") or set_("top_logprobs") \
            or doc.get("prompt_logprobs") is not None:
        return "logprobs (those of the tokens already sent cannot be carried over)"
    tools = doc.get("tools") or doc.get("functions")
    if tools and doc.get("tool_choice") != "none":
        return "tools (a tool call cannot be continued from part of it)"
    if doc.get("tool_choice") not in (None, "none", "auto"):
        return "tool_choice"
    response_format = doc.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return "response_format (structured output restarts its grammar from the start)"
    for key in _GUIDED:
        if set_(key):
            return f"{key} (structured output restarts its grammar from the start)"
    if set_("return_token_ids") or set_("return_tokens_as_token_ids"):
        return "token ids in the answer"
    if route == COMPLETIONS:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and not (len(prompt) == 1 and isinstance(prompt[0], str)):
            return "a prompt of token ids or several prompts"
        if not isinstance(prompt, (str, list)):
            return "a prompt that is not text"
        if doc.get("suffix") is not None:
            return "suffix"
    else:
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
        if set_("continue_final_message"):
            last = messages[-1]
            if not (isinstance(last, dict) and last.get("role") == "assistant"
                    and isinstance(last.get("content"), str)):
                return "continue_final_message on a final message without text content"
    return None


def upstream_body(doc: dict) -> dict:
    """The request as sent upstream: with vLLM's per-chunk usage (the tokens sent are counted from it)."""
    out = dict(doc)
    options = dict(doc.get("stream_options") or {})
    options["include_usage"] = True
    options["continuous_usage_stats"] = True
    out["stream_options"] = options
    return out


def error_event(message: str, code: str) -> bytes:
    """An OpenAI-shaped error as one SSE event, then ``[DONE]``: the end of a stream that failed."""
    return b"data: " + json.dumps(error_body(message, "server_error", code=code)).encode() + b"\n\n" + DONE


class Stream:
    """One streamed answer as the client sees it, across the replicas that produce it."""

    def __init__(self, doc: dict, route: str):
        self.doc = doc
        self.route = route
        options = doc.get("stream_options")
        if not isinstance(options, dict):
            options = {}
        self.client_usage = bool(options.get("include_usage"))
        self.client_continuous = self.client_usage and bool(options.get("continuous_usage_stats"))
        self.refusal = not_resumable(doc, route)   # None: resumable
        self.attempt = 0            # 0: the first replica's answer; n: the n-th resumption's
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.object: str = "chat.completion.chunk" if route == CHAT else "text_completion"
        self.text = ""              # the answer's text the client got
        self.tokens = 0             # the answer's tokens the client got
        self.base_tokens = 0        # those sent before the current attempt
        self._attempt_tokens = 0    # the current attempt's, as its usage (or its chunks) count them
        self.prompt_tokens: int | None = None   # the original prompt's, from the first replica's usage
        self.cached_tokens = 0      # of those, found in its prefix cache (prompt_tokens_details)
        self.finish_reason: str | None = None
        self.usage_sent = False
        self.done = False           # data: [DONE] went to the client
        self.upstream_error = False  # a replica answered an error event: an answer, not a break
        self.events = 0             # events that went to the client
        self.overflowed = False     # the replica sent an event over MAX_EVENT_BYTES: the stream ended there
        self._buffer = b""

    # --- the relay ----------------------------------------------------------------------------

    def feed(self, data: bytes) -> list[bytes]:
        """Bytes from the current replica; the whole events to send the client, rewritten. An event still
        unended past MAX_EVENT_BYTES ends the stream: an error event and [DONE] go out, nothing more is
        held or read (``overflowed``)."""
        if self.overflowed:
            return []
        self._buffer += data
        out = []
        while True:
            cut = self._buffer.find(b"\n\n")
            if cut < 0:
                break
            event, self._buffer = self._buffer[:cut + 2], self._buffer[cut + 2:]
            sent = self._event(event)
            if sent is not None:
                out.append(sent)
                self.events += 1
        if len(self._buffer) > MAX_EVENT_BYTES:
            self._buffer = b""
            self.overflowed = self.upstream_error = True   # an answer that failed: not resumed
            if not self.done:
                self.done = True
                out.append(error_event(
                    f"The replica sent a stream event longer than {MAX_EVENT_BYTES} bytes without ending it: a "
                    f"broken answer, ended here. Send the request again.", Code.EVENT_TOO_LONG))
        return out

    def _event(self, event: bytes) -> bytes | None:
        lines = event.strip(b"\r\n").split(b"\n")
        data = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
        if not data:
            return event   # a comment or another field: as it came
        if data.strip() == b"[DONE]":
            if self.done:
                return None
            self.done = True
            return DONE
        try:
            chunk = bounded_json.loads(data)
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        if "error" in chunk:
            self.upstream_error = True
            return event
        return self._chunk(chunk, event)

    def _chunk(self, chunk: dict, event: bytes) -> bytes | None:
        """The chunk as the client gets it: ``event`` itself when nothing in it changes."""
        changed = self.attempt > 0
        if self.id is None:
            self.id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
            self.object = chunk.get("object") or self.object
        else:
            chunk["id"], chunk["created"], chunk["model"] = self.id, self.created, self.model
        choices = chunk.get("choices") or []
        produced = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if self.route == CHAT:
                delta = choice.get("delta") or {}
                if self.attempt > 0:
                    delta.pop("role", None)   # the client had the role from the first replica
                text = delta.get("content") or ""
                if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                    # The replica parses tool calls or reasoning out of the text: the raw text is not
                    # what the client saw, so it cannot be handed to another replica to continue.
                    self.refusal = self.refusal or "tool calls or reasoning in the answer"
            else:
                text = choice.get("text") or ""
            if text:
                self.text += text
                produced = True
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            if self.attempt == 0 and isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
                self.cached_tokens = metering.cached_tokens(usage)
            if isinstance(usage.get("completion_tokens"), int):
                self._attempt_tokens = usage["completion_tokens"]
        elif produced:
            self._attempt_tokens += 1   # no usage from the replica: one token a chunk, as vLLM streams
        self.tokens = self.base_tokens + self._attempt_tokens
        if not choices and isinstance(usage, dict):   # the answer's final usage
            if not self.client_usage:
                return None
            self.usage_sent = True
            changed = True
            chunk["usage"] = self._usage(usage)
        elif "usage" in chunk:
            changed = True
            if self.client_continuous and isinstance(usage, dict):
                chunk["usage"] = self._usage(usage)
            else:
                del chunk["usage"]
        if self.attempt > 0 and self.route == CHAT and choices and all(
                isinstance(c, dict) and not any((c.get("delta") or {}).values())
                and c.get("finish_reason") is None and c.get("logprobs") is None for c in choices):
            return None   # the resumed replica's role announcement, less its role: nothing left to say
        if not changed:
            return event
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def _usage(self, upstream: dict) -> dict:
        usage = dict(upstream)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else upstream.get("prompt_tokens", 0)
        usage["prompt_tokens"] = prompt
        usage["completion_tokens"] = self.tokens
        usage["total_tokens"] = prompt + self.tokens
        return usage

    def counted(self) -> metering.Counted | None:
        """The tokens as the client's usage says them (the original prompt, every token of the answer);
        None before any replica reported usage."""
        if self.prompt_tokens is None:
            return None
        return metering.Counted(self.prompt_tokens, self.tokens, self.cached_tokens)

    # --- after a break ------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """The answer reached its end before the break (finish_reason sent), or its token limit."""
        limit = self.max_tokens()
        return self.finish_reason is not None or (limit is not None and self.tokens >= limit)

    def max_tokens(self) -> int | None:
        for key in ("max_completion_tokens", "max_tokens"):
            value = self.doc.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    def why_not(self) -> str | None:
        """Why the stream cannot be resumed now; None when it can (always, before any event was sent:
        then the continuation is the request itself)."""
        if self.events == 0:
            return None
        if self.upstream_error:
            return "the replica answered an error"
        return self.refusal

    def broke(self) -> None:
        """The current replica's stream ended before [DONE]: what it had not finished sending is dropped,
        and the next attempt counts its tokens after the ones sent."""
        self._buffer = b""
        self.base_tokens = self.tokens
        self._attempt_tokens = 0
        self.attempt += 1

    def continuation(self) -> dict:
        """The request for the next replica: the prompt and the text sent, the rest of the token budget."""
        doc = upstream_body(copy.deepcopy(self.doc))
        if self.text:
            if self.route == COMPLETIONS:
                prompt = doc["prompt"]
                doc["prompt"] = prompt + self.text if isinstance(prompt, str) else [prompt[0] + self.text]
            else:
                messages = list(doc["messages"])
                if doc.get("continue_final_message"):
                    last = dict(messages[-1])
                    last["content"] = last["content"] + self.text
                    messages[-1] = last
                else:
                    messages.append({"role": "assistant", "content": self.text})
                doc["messages"] = messages
                doc["continue_final_message"] = True
                doc["add_generation_prompt"] = False
        for key in ("max_completion_tokens", "max_tokens", "min_tokens"):
            value = doc.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                doc[key] = max(1 if key != "min_tokens" else 0, value - self.tokens)
        return doc

    def ending(self) -> bytes:
        """What the client still needs of an answer that was complete when its replica broke off: the
        finish (at the token limit: ``length``), the usage it asked for, and ``[DONE]``."""
        out = b""
        if self.finish_reason is None:
            self.finish_reason = "length"
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if self.route == CHAT:
                choice["delta"] = {"content": ""}
            else:
                choice["text"] = ""
            out += self._event_bytes({"choices": [choice]})
        if self.client_usage and not self.usage_sent:
            self.usage_sent = True
            prompt = self.prompt_tokens or 0
            out += self._event_bytes({"choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": self.tokens, "total_tokens": prompt + self.tokens}})
        self.done = True
        return out + DONE

    def _event_bytes(self, fields: dict) -> bytes:
        chunk = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, **fields}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
