"""Keep-alives follow what the client heard, not what the log held: a stream's reader is sent one
after each keep-alive interval (15 s, as shipped) in which it was sent nothing."""

import asyncio
import time
import uuid

from asgiref.sync import async_to_sync
from django.conf import settings

from inference import streamlog
from inference.gateway.sse import KEEPALIVE, Response, send_sse
from inference.protocol.chunks import ChunkWriter
from inference.protocol.entries import Delta, End, Line, Open, Usage
from inference.protocol.payloads import Admitted

HIDDEN_EVERY = 5.0  # an entry an API stream does not show, this often: under the interval


def test_entries_the_client_is_not_shown_do_not_hold_keep_alives_back(redis_client):
    """Seen in CI: during two long prefills the worker wrote the waiting request's place in line,
    which an API stream does not show; each such entry restarted the keep-alive wait, and the
    client heard 8 keep-alives in 151 s. Here hidden entries come every 5 s for a little over one
    interval: the client must still get its keep-alive."""
    admitted = Admitted(f"chatcmpl-{uuid.uuid4().hex}", "smollm2-135m-instruct", int(time.time()), prompt_tokens=5)
    sent = async_to_sync(stream_with_hidden_entries)(admitted, seconds=settings.TOKSTREAM_KEEPALIVE_SECONDS + 2)
    bodies = [message["body"] for message in sent if message["type"] == "http.response.body"]
    assert bodies.count(KEEPALIVE) == 1, bodies
    assert bodies[-1] == b"" and b"data: [DONE]" in b"".join(bodies)


async def stream_with_hidden_entries(admitted, seconds):
    """What send_sse sends an API stream while the log gets a Line entry every HIDDEN_EVERY
    seconds for `seconds`, then a delta and the end."""
    sent, client = [], streamlog.async_client()

    async def send(message):
        sent.append(message)

    stream = asyncio.ensure_future(send_sse(Response(send), client, ChunkWriter(admitted), admitted))
    writer = streamlog.sync_client()
    streamlog.append(writer, admitted.request_id, Open(1, 1))
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        await asyncio.sleep(HIDDEN_EVERY)
        streamlog.append(writer, admitted.request_id, Line(0))
    streamlog.append(writer, admitted.request_id, Delta("Hi", 1), End(["stop"], Usage(5, 1)))
    await asyncio.wait_for(stream, 30)
    return sent
