"""Request logs → requests (arrival time, prompt tokens, output tokens, duration).

Two formats, one JSON object per line:

* ``jsonl`` — ``{"timestamp": "2025-01-01T00:00:00Z", "prompt_tokens": 512,
  "output_tokens": 128, "latency_seconds": 2.1}``; ``completion_tokens`` is read
  when ``output_tokens`` is absent, ``duration`` when ``latency_seconds`` is.
* ``openai`` — an access log of OpenAI API responses: a ``usage`` object
  (``prompt_tokens``, ``completion_tokens``) at the top level or under
  ``response``, and ``timestamp`` or else ``created`` (the response's epoch seconds).

Timestamps are RFC 3339 strings or epoch seconds and mark the request's arrival.
A malformed line stops parsing with a message naming the line, the field and the
fix; with ``skip_invalid`` it is skipped instead. Nothing is dropped silently:
every skipped line is counted by reason.
"""
from __future__ import annotations

import dataclasses
import json
import math
from datetime import datetime, timezone
from typing import Any, Iterable

from ..errors import OperatorError
from .errors import RequestLogError

FORMATS = ("jsonl", "openai")

# Epoch seconds stay below this until the year 5138; epoch milliseconds of any
# date after 1973 are above it, so a larger number is almost surely milliseconds.
_EPOCH_SECONDS_LIMIT = 1e11
_PROBLEMS_KEPT = 5

SKIP_BLANK = "blank line"
SKIP_ERROR_RESPONSE = "error response without usage"
SKIP_INVALID = "invalid (--skip-invalid)"


@dataclasses.dataclass(frozen=True)
class Request:
    line: int
    start: float                # arrival, epoch seconds
    prompt_tokens: int
    output_tokens: int
    duration: float | None      # arrival to last token, seconds; None when the log lacks it


@dataclasses.dataclass(frozen=True)
class RequestLog:
    name: str
    format: str
    requests: list[Request]
    skipped: dict[str, int]             # reason → lines
    problems: list[str]                 # the first few messages of lines skipped as invalid
    naive_timestamps: int               # timestamps without a UTC offset, read as UTC

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


class _LineError(OperatorError):
    """A problem with one field of one line; the parser adds the line number."""


def parse_request_log(lines: Iterable[str], *, name: str, format: str = "auto",
                      skip_invalid: bool = False) -> RequestLog:
    """Parse a whole log. ``format`` is ``jsonl``, ``openai`` or ``auto``
    (decided by the first line that carries token counts)."""
    if format not in (*FORMATS, "auto"):
        raise RequestLogError(f"unknown log format {format!r}; use one of: auto, {', '.join(FORMATS)}")
    skipped: dict[str, int] = {}
    problems: list[str] = []
    rows: list[tuple[int, dict]] = []

    def skip(reason: str, message: str | None = None) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1
        if message and len(problems) < _PROBLEMS_KEPT:
            problems.append(message)

    def invalid(lineno: int, message: str) -> None:
        text = f"{name} line {lineno}: {message}"
        if not skip_invalid:
            raise RequestLogError(text)
        skip(SKIP_INVALID, text)

    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            skip(SKIP_BLANK)
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            invalid(lineno, f"not valid JSON ({e.msg} at column {e.colno}); "
                            "the log needs one JSON object per line")
            continue
        if not isinstance(obj, dict):
            invalid(lineno, f"expected a JSON object, found {type(obj).__name__}; "
                            "the log needs one JSON object per line")
            continue
        rows.append((lineno, obj))

    fmt = format if format != "auto" else _detect_format(rows, name)
    requests: list[Request] = []
    naive = 0
    for lineno, obj in rows:
        if fmt == "openai" and _usage(obj) is None and "error" in obj:
            # A refused or failed call cost no KV and produced no tokens.
            skip(SKIP_ERROR_RESPONSE)
            continue
        try:
            req, was_naive = (_parse_openai if fmt == "openai" else _parse_jsonl)(obj, lineno)
        except _LineError as e:
            invalid(lineno, str(e))
            continue
        requests.append(req)
        naive += was_naive
    if not requests:
        raise RequestLogError(f"{name}: no requests to plan from ({_describe_skips(skipped)}); "
                              "check the file and --format")
    return RequestLog(name=name, format=fmt, requests=requests, skipped=skipped,
                      problems=problems, naive_timestamps=naive)


def _describe_skips(skipped: dict[str, int]) -> str:
    if not skipped:
        return "the file is empty"
    return ", ".join(f"{n} skipped: {reason}" for reason, n in skipped.items())


def _usage(obj: dict) -> Any:
    if isinstance(obj.get("usage"), dict):
        return obj["usage"]
    response = obj.get("response")
    if isinstance(response, dict) and isinstance(response.get("usage"), dict):
        return response["usage"]
    return None


def _detect_format(rows: list[tuple[int, dict]], name: str) -> str:
    for _, obj in rows:
        if _usage(obj) is not None:
            return "openai"
        if "prompt_tokens" in obj:
            return "jsonl"
    raise RequestLogError(
        f"{name}: cannot tell the log format: no line has a prompt_tokens field (jsonl) or a usage "
        "object (openai access log); add those fields or pass --format jsonl|openai")


def _parse_jsonl(obj: dict, lineno: int) -> tuple[Request, bool]:
    start, naive = parse_timestamp(_require(obj, "timestamp", "the request's arrival time, RFC 3339 "
                                                              "or epoch seconds"), "timestamp")
    prompt = _tokens(_require(obj, "prompt_tokens", "an integer ≥ 0"), "prompt_tokens")
    out_field = "output_tokens" if obj.get("output_tokens") is not None else "completion_tokens"
    if obj.get(out_field) is None:
        raise _LineError('missing field "output_tokens" (or "completion_tokens"): add the number '
                         "of generated tokens, an integer ≥ 0")
    output = _tokens(obj[out_field], out_field)
    return Request(lineno, start, prompt, output, _duration(obj)), naive


def _parse_openai(obj: dict, lineno: int) -> tuple[Request, bool]:
    usage = _usage(obj)
    if usage is None:
        raise _LineError('missing field "usage": each line needs the response\'s usage object '
                         '{"prompt_tokens", "completion_tokens"}; for streamed responses request it '
                         'with stream_options {"include_usage": true}')
    prompt = _tokens(_require(usage, "prompt_tokens", "an integer ≥ 0", prefix="usage."), "usage.prompt_tokens")
    output = _tokens(_require(usage, "completion_tokens", "an integer ≥ 0", prefix="usage."),
                     "usage.completion_tokens")
    response: dict[str, Any] = obj["response"] if isinstance(obj.get("response"), dict) else {}
    if obj.get("timestamp") is not None:
        start, naive = parse_timestamp(obj["timestamp"], "timestamp")
    elif obj.get("created") is not None:
        start, naive = parse_timestamp(obj["created"], "created")
    elif response.get("created") is not None:
        start, naive = parse_timestamp(response["created"], "response.created")
    else:
        raise _LineError('missing field "timestamp" (or "created"): add the request\'s arrival time, '
                         "RFC 3339 or epoch seconds")
    return Request(lineno, start, prompt, output, _duration(obj)), naive


def _require(obj: dict, key: str, what: str, prefix: str = "") -> Any:
    if obj.get(key) is None:
        raise _LineError(f'missing field "{prefix}{key}": add it ({what})')
    return obj[key]


def _tokens(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _LineError(f'field "{field}" is {value!r}; write a JSON integer ≥ 0')
    if isinstance(value, float) and not value.is_integer():
        raise _LineError(f'field "{field}" is {value!r}; token counts are whole numbers')
    if value < 0:
        raise _LineError(f'field "{field}" is {value!r}; token counts cannot be negative')
    return int(value)


def _duration(obj: dict) -> float | None:
    field = "latency_seconds" if obj.get("latency_seconds") is not None else "duration"
    value = obj.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _LineError(f'field "{field}" is {value!r}; write the request\'s duration in seconds, '
                         "a number ≥ 0, or leave the field out to have it estimated")
    return float(value)


def parse_timestamp(value: Any, field: str = "timestamp") -> tuple[float, bool]:
    """RFC 3339 string or epoch seconds → (epoch seconds, whether the string lacked an offset)."""
    if isinstance(value, str):
        text = value.strip()
        try:
            return _epoch_seconds(float(text), field), False
        except ValueError:
            pass
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise _LineError(f'field "{field}" is {value!r}, not a timestamp; write RFC 3339 '
                             '(e.g. "2025-01-31T12:00:00.250Z") or epoch seconds') from None
        if parsed.tzinfo is None:
            return parsed.replace(tzinfo=timezone.utc).timestamp(), True
        return parsed.timestamp(), False
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _LineError(f'field "{field}" is {value!r}; write RFC 3339 or epoch seconds')
    return _epoch_seconds(float(value), field), False


def _epoch_seconds(value: float, field: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise _LineError(f'field "{field}" is {value!r}; epoch seconds must be a finite number ≥ 0')
    if value >= _EPOCH_SECONDS_LIMIT:
        raise _LineError(f'field "{field}" is {value!r}, which looks like epoch milliseconds; '
                         "divide by 1000 (epoch seconds) or write RFC 3339")
    return value
