"""The log's wire format: what this version writes, a process of the previous version still
reads (a rolling deploy runs both), and what a newer writer adds, this one ignores."""

import json

from inference.protocol.chunks import ChunkWriter
from inference.protocol.entries import Accepted, Delta, End, Line, Open, Refusal, Steer, ToolArgs, ToolStart, Usage, decode, encode, usage_of
from inference.protocol.payloads import Admitted

# As the dict-literal writers wrote them before the entries were types.
OLD_FORMAT = [
    (Open(1, 0), {"t": "open", "n": 1, "queue_position": 0}),
    (Delta("Hi", 3), {"t": "delta", "text": "Hi", "n": 3}),
    (Delta("", 4, 1, logprobs=[{"token": "x"}]), {"t": "delta", "text": "", "n": 4, "i": 1, "logprobs": [{"token": "x"}]}),
    (Steer("be brief", 40), {"t": "steer", "text": "be brief", "prompt_tokens": 40}),
    (Steer("x", 41, 2, error="too long"), {"t": "steer", "text": "x", "prompt_tokens": 41, "i": 2, "error": "too long"}),
    (ToolStart(0, "call_0", "weather"), {"t": "tool", "index": 0, "id": "call_0", "name": "weather"}),
    (ToolArgs(0, '{"city"', 1), {"t": "args", "index": 0, "text": '{"city"', "i": 1}),
    (End(["stop"], Usage(5)), {"t": "end", "finish_reasons": ["stop"], "usage": {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}}),
    (
        End(["error"], error="lost", code="request_lost"),
        {"t": "end", "finish_reasons": ["error"], "usage": usage_of(0, 0), "error": "lost", "code": "request_lost"},
    ),
]


def test_every_kind_is_written_as_before():
    for entry, old in OLD_FORMAT:
        assert json.loads(encode(entry)) == old


def test_an_old_log_reads_back_as_the_same_entries():
    for entry, old in OLD_FORMAT:
        assert decode(json.dumps(old)) == entry


def test_a_field_of_a_newer_writer_is_ignored():
    assert decode(json.dumps({"t": "delta", "text": "a", "n": 1, "from_the_future": True})) == Delta("a", 1)


def test_a_kind_of_a_newer_writer_is_skipped_by_readers():
    from inference import streamlog

    assert decode(json.dumps({"t": "from_the_future", "x": 1})) is None
    log = [("1-0", {"e": encode(Delta("a", 1))}), ("2-0", {"e": '{"t": "from_the_future"}'}), ("3-0", {"e": encode(End(["stop"]))})]
    assert streamlog.decode_entries(log) == [("1-0", Delta("a", 1)), ("3-0", End(["stop"]))]


def test_a_place_in_line_reaches_the_chat_page_and_no_api_stream():
    assert json.loads(encode(Line(2))) == {"t": "line", "ahead": 2} and json.loads(encode(Line())) == {"t": "line"}
    assert decode(encode(Line(2))) == Line(2) and decode(encode(Line())) == Line()
    admitted = Admitted("chatcmpl-1", "m", 1700000000, 7)
    page = ChunkWriter(admitted, include_usage=True, continuous_usage=True, places=True)
    [waiting] = page.chunks(Line(2))
    [reading] = page.chunks(Line())
    assert waiting["choices"] == [] and waiting["tokstream"] == {"queue_position": 2}
    assert reading["choices"] == [] and reading["tokstream"] == {"reading_prompt": True}
    assert ChunkWriter(admitted, include_usage=True).chunks(Line(2)) == []


def test_an_upstreams_acceptance_and_refusal_read_back_as_written():
    refused = End(
        ["error"],
        Usage(),
        error="the upstream answered 429: slow down",
        code="rate_limit_exceeded",
        refusal=Refusal(429, "requests", None, "7"),
    )
    for entry in (Accepted(), refused):
        assert decode(encode(entry)) == entry
    assert json.loads(encode(Accepted())) == {"t": "accepted"}
