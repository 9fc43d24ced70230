"""The log's wire format: what this version writes, a process of the previous version still
reads (a rolling deploy runs both), and what a newer writer adds, this one ignores."""

import json

from inference.protocol.entries import Accepted, Delta, End, Open, Steer, ToolArgs, ToolStart, decode, encode

# As the dict-literal writers wrote them before the entries were types.
OLD_FORMAT = [
    (Open(1, 0), {"t": "open", "n": 1, "queue_position": 0}),
    (Delta("Hi", 3), {"t": "delta", "text": "Hi", "n": 3}),
    (Delta("", 4, 1, logprobs=[{"token": "x"}]), {"t": "delta", "text": "", "n": 4, "i": 1, "logprobs": [{"token": "x"}]}),
    (Steer("be brief", 40), {"t": "steer", "text": "be brief", "prompt_tokens": 40}),
    (Steer("x", 41, 2, error="too long"), {"t": "steer", "text": "x", "prompt_tokens": 41, "i": 2, "error": "too long"}),
    (ToolStart(0, "call_0", "weather"), {"t": "tool", "index": 0, "id": "call_0", "name": "weather"}),
    (ToolArgs(0, '{"city"', 1), {"t": "args", "index": 0, "text": '{"city"', "i": 1}),
    (End(["stop"], {"prompt_tokens": 5}), {"t": "end", "finish_reasons": ["stop"], "usage": {"prompt_tokens": 5}}),
    (End(["error"], {}, error="lost", code="request_lost"), {"t": "end", "finish_reasons": ["error"], "usage": {}, "error": "lost", "code": "request_lost"}),
]


def test_every_kind_is_written_as_before():
    for entry, old in OLD_FORMAT:
        assert json.loads(encode(entry)) == old


def test_an_old_log_reads_back_as_the_same_entries():
    for entry, old in OLD_FORMAT:
        assert decode(json.dumps(old)) == entry


def test_a_field_of_a_newer_writer_is_ignored():
    assert decode(json.dumps({"t": "delta", "text": "a", "n": 1, "from_the_future": True})) == Delta("a", 1)


def test_an_upstreams_acceptance_and_refusal_read_back_as_written():
    refused = End(
        ["error"],
        {},
        error="the upstream answered 429: slow down",
        code="rate_limit_exceeded",
        refusal={"status": 429, "type": "requests", "param": None, "retry_after": "7"},
    )
    for entry in (Accepted(), refused):
        assert decode(encode(entry)) == entry
    assert json.loads(encode(Accepted())) == {"t": "accepted"}
