"""SSE framing: what leaves the server, read back as clients read it; and TOKSTREAM_COALESCE_MS."""

import asyncio

import pytest

from inference import streamlog
from inference.gateway import sse
from inference.protocol.entries import Delta, End
from inference.protocol.payloads import Admitted


@pytest.fixture
def log(redis_client):
    request_id = "chatcmpl-coalescing"
    texts = [("Hel", 0), ("lo", 0), (" wor", 0), ("ld", 0), ("¡", 1), ("!", 1)]
    ids = [streamlog.append(redis_client, request_id, Delta(text, n + 1, i)) for n, (text, i) in enumerate(texts)]
    ids.append(streamlog.append(redis_client, request_id, End(["stop", "stop"])))
    yield Admitted(request_id, "a-model", 0, 3), ids
    redis_client.delete(streamlog.key(request_id, "log"))


def read(admitted):
    async def collect():
        return [pair async for pair in sse.entries(streamlog.async_client(), admitted, "0-0")]

    return asyncio.run(collect())


def test_deltas_in_the_window_are_merged_whole_per_choice_and_in_order(log, settings):
    admitted, ids = log
    settings.TOKSTREAM_COALESCE_MS = 50
    merged = read(admitted)
    assert [(getattr(entry, "text", None), getattr(entry, "i", None)) for _, entry in merged] == [("Hello world", 0), ("¡!", 1), (None, None)]
    assert [entry_id for entry_id, _ in merged] == [ids[3], ids[5], ids[6]]  # a resume from them loses nothing
    assert merged[0][1].completion_tokens == 4


def test_by_default_every_delta_passes_through(log, settings):
    admitted, ids = log
    settings.TOKSTREAM_COALESCE_MS = 0
    assert [entry_id for entry_id, _ in read(admitted)] == ids


def test_the_framing_gives_the_openai_sdk_only_whole_events():
    """Keep-alives and the retry hint between events, read by the SDK's own SSE decoder."""
    from openai._streaming import SSEDecoder

    from inference.protocol.chunks import sse_frames

    stream = sse.retry_hint() + sse_frames("1-0", [{"a": 1}]) + sse.KEEPALIVE + sse.KEEPALIVE + sse_frames("2-0", [{"b": 2}], done=True)
    events = list(SSEDecoder().iter_bytes(iter([stream[i : i + 7] for i in range(0, len(stream), 7)])))
    assert [event.data for event in events] == ['{"a":1}', '{"b":2}', "[DONE]"]
    assert [event.id for event in events] == ["1-0", "2-0.0", "2-0"]
