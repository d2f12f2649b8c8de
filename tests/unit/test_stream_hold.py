"""The relay that holds a streamed answer at a known event (tests/support/stream_hold.py), which the stream
resumption tests rely on to kill vLLM mid-answer: however vLLM's bytes are split into reads, exactly the
first N events reach the guard and the rest is kept back."""
from __future__ import annotations

import json
import random

import pytest

from tests.support.stream_hold import Hold, _ClaimedAnswer


def answer(tokens: int) -> bytes:
    """A streamed completion as vLLM writes it: headers, then one chunked SSE event per token."""
    body = b""
    for i in range(tokens):
        event = b"data: " + json.dumps({"choices": [{"text": f"t{i} ", "finish_reason": None}]}).encode() + b"\n\n"
        body += f"{len(event):x}\r\n".encode() + event + b"\r\n"
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body


@pytest.mark.parametrize("seed", range(20))
def test_exactly_the_first_events_pass_however_the_reads_split(seed):
    rng = random.Random(seed)
    data = answer(12)
    hold = Hold(events=4)
    claimed = _ClaimedAnswer(hold)
    passed = kept = b""
    position = 0
    while position < len(data):
        size = rng.randint(1, 90)
        out, back = claimed.split(data[position:position + size])
        passed, kept, position = passed + out, kept + back, position + size
    assert hold.held.is_set()
    assert passed + kept == data
    assert passed.count(b"\n\n") == 4 and passed.endswith(b"\n\n")
    assert hold.forwarded_text() == "t0 t1 t2 t3 " and not hold.finished_within()


def test_an_answer_shorter_than_the_hold_passes_whole_and_says_it_finished():
    data = answer(2).replace(b'"finish_reason": null}]}', b'"finish_reason": "stop"}]}', 1)
    hold = Hold(events=4)
    out, kept = _ClaimedAnswer(hold).split(data)
    assert out == data and kept == b"" and not hold.held.is_set() and hold.finished_within()


@pytest.mark.parametrize("seed", range(10))
def test_a_hold_of_no_events_passes_the_headers_and_keeps_a_plain_body_back(seed):
    rng = random.Random(seed)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 27\r\n\r\n"
    data = head + b'{"choices": [{"text": "x"}]}'
    hold = Hold(events=0, streamed=False)
    claimed = _ClaimedAnswer(hold)
    passed = kept = b""
    position = 0
    while position < len(data):
        size = rng.randint(1, 40)
        out, back = claimed.split(data[position:position + size])
        passed, kept, position = passed + out, kept + back, position + size
    assert passed == head and kept == data[len(head):] and hold.held.is_set()
