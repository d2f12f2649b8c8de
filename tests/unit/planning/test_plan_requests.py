"""Reading request logs: both formats, auto-detection, and errors that name the
line, the field and the fix."""
from __future__ import annotations

import json

import pytest

from gpufleet.planning.errors import RequestLogError
from gpufleet.planning.requests import SKIP_BLANK, SKIP_ERROR_RESPONSE, SKIP_INVALID, parse_request_log, parse_timestamp


def parse(lines, **kw):
    return parse_request_log(lines, name="log.jsonl", **kw)


def test_jsonl_fields_and_aliases():
    log = parse([
        '{"timestamp": "2025-01-01T00:00:00Z", "prompt_tokens": 10, "output_tokens": 5, "latency_seconds": 1.5}',
        '{"timestamp": 1735689601.25, "prompt_tokens": 20, "completion_tokens": 7, "duration": 2}',
        '{"timestamp": "1735689602", "prompt_tokens": 0, "output_tokens": 0}',
    ])
    assert log.format == "jsonl"
    a, b, c = log.requests
    assert (a.start, a.prompt_tokens, a.output_tokens, a.duration) == (1735689600.0, 10, 5, 1.5)
    assert (b.start, b.prompt_tokens, b.output_tokens, b.duration) == (1735689601.25, 20, 7, 2.0)
    assert (c.start, c.duration) == (1735689602.0, None)
    assert [r.line for r in log.requests] == [1, 2, 3]
    assert log.skipped == {}


def test_openai_access_log_detected_and_read():
    lines = [
        json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1735689600,
                    "usage": {"prompt_tokens": 31, "completion_tokens": 9, "total_tokens": 40}}),
        json.dumps({"timestamp": "2025-01-01T00:00:02+01:00", "latency_seconds": 0.5,
                    "response": {"created": 1, "usage": {"prompt_tokens": 12, "completion_tokens": 3}}}),
        json.dumps({"created": 1735689603, "error": {"message": "rate limited", "code": 429}}),
    ]
    log = parse(lines)
    assert log.format == "openai"
    first, second = log.requests
    assert (first.start, first.prompt_tokens, first.output_tokens, first.duration) == (1735689600, 31, 9, None)
    # The explicit timestamp wins over response.created; +01:00 is one hour before UTC midnight + 2 s.
    assert second.start == 1735689600 - 3600 + 2
    assert (second.prompt_tokens, second.output_tokens, second.duration) == (12, 3, 0.5)
    assert log.skipped == {SKIP_ERROR_RESPONSE: 1}


def test_blank_lines_are_counted_not_silently_dropped():
    log = parse(["", '{"timestamp": 1, "prompt_tokens": 1, "output_tokens": 1}', "   "])
    assert log.skipped == {SKIP_BLANK: 2}
    assert log.skipped_total == 2


def test_naive_timestamps_read_as_utc_and_counted():
    log = parse(['{"timestamp": "2025-01-01T00:00:00", "prompt_tokens": 1, "output_tokens": 1}'])
    assert log.requests[0].start == 1735689600
    assert log.naive_timestamps == 1


@pytest.mark.parametrize("line, expected", [
    ('{"timestamp": 1, "output_tokens": 5}', ['line 3', '"prompt_tokens"', "add it"]),
    ('{"timestamp": 1, "prompt_tokens": 5}', ['line 3', '"output_tokens"', "completion_tokens"]),
    ('{"prompt_tokens": 5, "output_tokens": 5}', ['line 3', '"timestamp"', "RFC 3339"]),
    ('{"timestamp": 1, "prompt_tokens": "5", "output_tokens": 5}', ['line 3', '"prompt_tokens"', "JSON integer"]),
    ('{"timestamp": 1, "prompt_tokens": 5.5, "output_tokens": 5}', ['line 3', '"prompt_tokens"', "whole"]),
    ('{"timestamp": 1, "prompt_tokens": -1, "output_tokens": 5}', ['line 3', '"prompt_tokens"', "negative"]),
    ('{"timestamp": 1735689600000, "prompt_tokens": 5, "output_tokens": 5}',
     ['line 3', '"timestamp"', "milliseconds", "divide by 1000"]),
    ('{"timestamp": "yesterday", "prompt_tokens": 5, "output_tokens": 5}', ['line 3', '"timestamp"', "RFC 3339"]),
    ('{"timestamp": 1, "prompt_tokens": 5, "output_tokens": 5, "latency_seconds": -2}',
     ['line 3', '"latency_seconds"', "leave the field out"]),
    ('{"timestamp": 1, "prompt_tokens": 5,', ['line 3', "not valid JSON", "one JSON object per line"]),
    ('[1, 2]', ['line 3', "expected a JSON object"]),
])
def test_bad_line_names_line_field_and_fix(line, expected):
    good = '{"timestamp": 1, "prompt_tokens": 1, "output_tokens": 1}'
    with pytest.raises(RequestLogError) as e:
        parse([good, good, line], format="jsonl")
    message = str(e.value)
    assert message.startswith("log.jsonl line 3: ")
    for part in expected:
        assert part in message


def test_openai_line_without_usage_explains_streaming_fix():
    good = json.dumps({"created": 1, "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    with pytest.raises(RequestLogError) as e:
        parse([good, json.dumps({"created": 2, "choices": []})])
    assert "line 2" in str(e.value) and '"usage"' in str(e.value) and "include_usage" in str(e.value)


def test_openai_usage_missing_completion_tokens():
    with pytest.raises(RequestLogError, match=r'line 1: missing field "usage.completion_tokens"'):
        parse([json.dumps({"created": 1, "usage": {"prompt_tokens": 1}})])


def test_skip_invalid_counts_and_reports_the_first_problems():
    good = '{"timestamp": 1, "prompt_tokens": 1, "output_tokens": 1}'
    lines = [good, "{oops", good] + ['{"timestamp": 1}'] * 7
    log = parse(lines, skip_invalid=True)
    assert len(log.requests) == 2
    assert log.skipped == {SKIP_INVALID: 8}
    assert len(log.problems) == 5        # the first few, each naming its line
    assert log.problems[0].startswith("log.jsonl line 2: not valid JSON")
    assert log.problems[1].startswith('log.jsonl line 4: missing field "prompt_tokens"')


def test_undetectable_format_says_which_fields_are_expected():
    with pytest.raises(RequestLogError, match="cannot tell the log format.*--format"):
        parse(['{"ts": 1, "tokens": 3}'])


def test_empty_log_is_an_error_naming_the_skips():
    with pytest.raises(RequestLogError, match=r"no requests to plan from \(2 skipped: blank line\)"):
        parse(["", ""], format="jsonl")


def test_unknown_format():
    with pytest.raises(RequestLogError, match="unknown log format 'csv'"):
        parse([], format="csv")


def test_timestamp_forms_agree():
    assert parse_timestamp("2025-01-01T00:00:00.500Z")[0] == 1735689600.5
    assert parse_timestamp("2025-01-01T00:00:00.500+00:00")[0] == 1735689600.5
    assert parse_timestamp(1735689600.5)[0] == 1735689600.5
    assert parse_timestamp("1735689600.5")[0] == 1735689600.5
