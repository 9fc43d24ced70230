"""The streaming endpoints, as plain ASGI apps under Channels.

A Channels consumer cannot see http.disconnect while it streams (channels#1249), so each
response is sent from a task while this coroutine keeps reading receive(): a client that leaves
is noticed at once, and its request is cancelled.
"""

import asyncio
import dataclasses
import json
import logging
import time
from contextlib import aclosing
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import close_old_connections

from inference import backends, lifecycle, streamlog
from inference.gateway import tail
from inference.gateway.admission import Owner, admit, owned_meta
from inference.gateway.auth import key_owner, required_owner
from inference.protocol import chat_request
from inference.protocol.chunks import (
    ChunkWriter,
    completion,
    error_of,
    resume_point,
    sse_frames,
    unnumbered_frames,
    valid_event_id,
)
from inference.protocol.entries import TEXT_KINDS, Accepted, Delta, End, Line, Open
from inference.protocol.errors import (
    ApiError,
    invalid,
    too_large,
    unauthorized,
)
from inference.protocol.payloads import State

log = logging.getLogger(__name__)


class ClientGone(Exception):
    pass


# A comment line alone, without the blank line that ends an event: once a stream has sent an
# id, the openai SDK turns any blank line into an event and fails on its empty data.
KEEPALIVE = b": keep-alive\n"
# How often a chat page's reply that waits for a worker reads its place in the queue: a ZRANK a
# second for each such page, and a place a second late is still news.
QUEUE_PLACE_SECONDS = 1.0


def retry_hint():
    """Sent on the first event (a lone `retry:` block trips the openai SDK, as above). The
    browser must come back well within the grace before an abandoned request is cancelled."""
    milliseconds = min(3000, max(500, settings.TOKSTREAM_ABANDON_SECONDS * 500))
    return f"retry: {milliseconds}\n".encode()


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def header(scope, name):
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


async def read_body(scope, receive):
    limit = settings.TOKSTREAM_MAX_BODY_BYTES
    if header(scope, b"content-length").isdigit() and int(header(scope, b"content-length")) > limit:
        raise too_large(limit)
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body += message.get("body", b"")
        if len(body) > limit:
            raise too_large(limit)
        if not message.get("more_body"):
            return bytes(body)


async def bearer_owner(scope):
    return await database_sync_to_async(key_owner)(header(scope, b"authorization"))


async def session_owner(scope):
    user = scope.get("user")
    if user is None or not await database_sync_to_async(lambda: user.is_authenticated)():
        return None
    return Owner(user_id=user.pk)


async def wait_for_disconnect(receive):
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, work):
    """Run `work` while watching for the client leaving: (True if the client left first,
    what the work returned)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    left = task not in done
    (task if left else watcher).cancel()
    return left, None if left else task.result()  # re-raises what the work raised


async def entries(client, admitted, last_id):
    """Yield (id, entry) from the log after last_id until the end entry, live, as this
    process's tail reads it (inference/gateway/tail.py).

    While the log is idle, check that someone will write it (see `idle_check`); a request
    whose worker is gone is ended here (inference.lifecycle), and the end entry that writes is
    read like any other. Raises StreamLost when Redis no longer knows the request.
    """
    logs = tail.tail()
    follower = await logs.follow(admitted.request_id, last_id)
    try:
        async for pair in followed(client, admitted, follower):
            yield pair
    finally:
        await logs.leave(follower)


async def followed(client, admitted, follower):
    unserved = 0
    while True:
        batch = await follower.next(settings.TOKSTREAM_KEEPALIVE_SECONDS)
        if batch and settings.TOKSTREAM_COALESCE_MS:
            batch = await coalesced(follower, batch)
        if not batch:
            unserved, verdict = await idle_check(client, admitted, unserved)
            batch = await follower.read_now(client) if verdict == State.ENDED else []
            if verdict == State.ENDED and not batch:
                return  # it ended before the point this reader resumed from
        for entry_id, entry in batch:
            yield entry_id, entry
            if isinstance(entry, End):
                return


class StreamLost(Exception):
    code = "request_lost"


async def idle_check(client, admitted, unserved):
    """(idle intervals in a row with no live worker for the model, and "ended" if the request
    is over): `lifecycle.verdict` decides, and the reader ends what nobody else will. No live
    worker must be seen two idle intervals in a row (one could be a worker restarting)."""
    request_id = admitted.request_id
    async with client.pipeline(transaction=False) as pipe:
        lifecycle.Seen.read(pipe, request_id)
        seen = lifecycle.Seen.of(await pipe.execute())
    found = lifecycle.verdict(seen, admitted.model, time.time())
    if found == lifecycle.Verdict.LOST:
        raise StreamLost(lifecycle.MESSAGES[found])
    if found in (lifecycle.Verdict.ENDED, lifecycle.Verdict.ENDING):
        return 0, State.ENDED  # whoever ends it wrote, or writes next, the end entry
    unserved = unserved + 1 if found == lifecycle.Verdict.UNSERVED else 0
    if found is not None and (found != lifecycle.Verdict.UNSERVED or unserved >= 2):
        await reap(client, request_id, seen, found)
    return unserved, None


async def reap(client, request_id, seen, found):
    """End the request here, unless someone else (its worker) moved first."""
    if seen.ending() or await lifecycle.take_over(client, request_id, seen.status, found):
        log.warning("request %s ended by its reader: %s", request_id, found)
        await sync_to_async(lifecycle.end_from_reader, thread_sensitive=False)(request_id, found)


async def coalesced(follower, batch):
    """What else arrives within the window, with runs of plain deltas of one choice merged into
    one (whole entries only: no character is split, nothing reordered). The merged event keeps
    the id of its last entry, so a resume from it continues exactly after it."""
    await asyncio.sleep(settings.TOKSTREAM_COALESCE_MS / 1000)
    batch += follower.take()
    merged = []
    for entry_id, entry in batch:
        previous = merged[-1][1] if merged else None
        if mergeable(previous, entry):
            merged[-1] = (entry_id, dataclasses.replace(entry, text=previous.text + entry.text))
        else:
            merged.append((entry_id, entry))
    return merged


def mergeable(previous, entry):
    def plain(e):
        return isinstance(e, Delta) and e.logprobs is None

    return plain(previous) and plain(entry) and previous.i == entry.i


class Response:
    """One HTTP response, tracked so that whatever fails, it ends exactly once: an error in
    the OpenAI shape before it started, the end of the body after. Daphne must never see an
    exception once the headers went out (it then tries a 500, and its cleanup breaks)."""

    def __init__(self, send):
        self.send = send
        self.started = self.ended = False

    async def start(self, status, headers):
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data):
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data=b""):
        self.ended = True
        await self.send({"type": "http.response.body", "body": data})

    async def json(self, status, payload, headers=()):
        await self.start(status, [(b"content-type", b"application/json"), *headers])
        await self.end(json.dumps(payload).encode())

    async def error(self, exc):
        await self.json(exc.status, exc.body(), [(name.lower().encode(), value.encode()) for name, value in exc.headers.items()])

    async def empty(self, status):
        await self.start(status, [])
        await self.end()

    async def fail(self):
        """After an unexpected exception: end the response, whatever state it is in."""
        try:
            if not self.started:
                await self.error(ApiError(500, "The server failed while answering; nothing was kept.", type="server_error"))
            elif not self.ended:
                await self.end()
        except Exception:  # the client is gone, say: nothing more to do
            log.debug("could not end a failed response", exc_info=True)


class SseBody:
    """The body of a stream. A relayed request's stream holds its status line back until its
    upstream answers, so that an upstream's refusal reaches the client as the upstream's own
    status: it starts at the upstream's first answer, or at the first keep-alive (a request
    waiting for a slot at its upstream then sees its queue position and keep-alives)."""

    def __init__(self, response, admitted, hold):
        self.response, self.held = response, [] if hold else None
        self.headers = [*SSE_HEADERS, (b"x-request-id", admitted.request_id.encode())]
        self.retry = retry_hint()
        self.last_sent = time.monotonic()

    async def write(self, data):
        await self.response.body(data)
        self.last_sent = time.monotonic()

    async def start(self):
        await self.response.start(200, self.headers)
        held, self.held = self.held or [], None
        if held:
            await self.send(b"".join(held))

    async def send(self, data):
        if data:  # an entry with no event (Accepted) sends nothing
            await self.write(self.retry + data)
            self.retry = b""

    async def frames(self, data, entry):
        if not data and not isinstance(entry, Accepted):
            return  # an entry this reader is not shown (a place in line, for an API stream)
        if self.held is not None and isinstance(entry, End) and entry.refusal:
            self.held = None
            return await self.response.error(error_of(entry))
        if self.held is not None and isinstance(entry, Open):
            return self.held.append(data)
        if not self.response.started:
            await self.start()
        await self.send(data)

    async def keep_alive(self):
        if not self.response.started:
            await self.start()
        await self.write(KEEPALIVE)

    async def keep_alive_while_quiet(self):
        """A keep-alive after each KEEPALIVE_SECONDS in which the client was sent nothing. The
        clock is what the client heard, not the log: entries it is not shown (an API stream's
        place in line) arrive during a long prefill, and timing from them held keep-alives back
        (8 in 151 s, seen in CI)."""
        interval = settings.TOKSTREAM_KEEPALIVE_SECONDS
        while True:
            await asyncio.sleep(self.last_sent + interval - time.monotonic())
            if time.monotonic() - self.last_sent >= interval:
                await self.keep_alive()

    async def end(self, data=b""):
        if not self.response.started:
            await self.start()
        await self.send(data)
        if not self.response.ended:
            await self.response.end()


async def send_sse(response, client, writer, admitted, last_event_id="", hold=False):
    last_id, skip = resume_point(last_event_id) if last_event_id else ("0-0", 0)
    body = SseBody(response, admitted, hold)
    if not hold:
        await body.start()
    watch = asyncio.ensure_future(tell_queue_place(body, client, writer)) if writer.places else None
    keeping_alive = asyncio.ensure_future(body.keep_alive_while_quiet())
    try:
        async with aclosing(entries(client, admitted, last_id)) as stream:
            async for entry_id, entry in stream:
                if watch is not None and not isinstance(entry, Open):
                    await stopped(watch)  # past its opening, a worker took it: its engine tells the rest
                await body.frames(sse_frames(entry_id, writer.chunks(entry), done=isinstance(entry, End), skip=skip), entry)
                skip = 0
    except Exception as exc:  # Redis failed or forgot the request: an ending, never silence
        log.warning("the stream of %s was interrupted: %r", admitted.request_id, exc)
        writer.interrupted = True
        ending = unnumbered_frames(writer.interrupted_chunks(interruption(exc)))
    else:
        ending = b""
    finally:
        await stopped(keeping_alive)
        if watch is not None:
            await stopped(watch)
    await body.end(ending)


async def tell_queue_place(body, client, writer):
    """The chat page's reply while it waits for a worker to take it: its place in its model's
    queue each time it moves (the opening told where it joined). Events without ids: they are
    not in the log, and a resume never needs them."""
    admitted, told = writer.admitted, None
    while True:
        await asyncio.sleep(QUEUE_PLACE_SECONDS)
        place = await client.zrank(streamlog.queue_key(admitted.model), admitted.request_id)
        if place is None:
            return  # a worker took it (or it ended)
        if place != told:
            told = place
            await body.send(unnumbered_frames(writer.chunks(Line(place)), done=False))


async def stopped(task):
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def interruption(exc):
    if isinstance(exc, StreamLost):
        return ApiError(503, str(exc), type="server_error", code=exc.code)
    message = f"The stream could not be read on ({type(exc).__name__}); the request may have ended: resume from the last event id."
    return ApiError(503, message, type="server_error", code="stream_interrupted")


async def respond_whole(response, client, admitted):
    deltas = []
    try:
        async with aclosing(entries(client, admitted, "0-0")) as stream:
            async for _, entry in stream:
                if isinstance(entry, TEXT_KINDS):
                    deltas.append(entry)
        await response.json(200, completion(admitted, deltas, entry))
    except ApiError as exc:
        await response.error(exc)
    except Exception as exc:
        log.warning("the answer of %s was interrupted: %r", admitted.request_id, exc)
        await response.error(interruption(exc))
        return True
    return False


class StreamingApp:
    """An ASGI app whose `serve` may fail anywhere: its response still ends, once."""

    async def __call__(self, scope, receive, send):
        response = Response(send)
        try:
            await self.serve(scope, receive, response)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await response.fail()


class ChatCompletions(StreamingApp):
    """POST /v1/chat/completions, streamed or whole; the client leaving cancels the request."""

    async def serve(self, scope, receive, response):
        try:
            chat, admitted = await self.admit(scope, receive)
        except ApiError as exc:
            return await response.error(exc)
        except ClientGone:
            return
        client = streamlog.async_client()
        writer = ChunkWriter(admitted, chat.include_usage, chat.continuous_usage)
        relayed = backends.of(chat.model).engine is None
        work = send_sse(response, client, writer, admitted, hold=relayed) if chat.stream else respond_whole(response, client, admitted)
        # Counted as a reader, so a resume elsewhere that ends does not cancel this stream.
        left, interrupted = await follow(receive, work, client, admitted.request_id)
        if (left is not None or interrupted or writer.interrupted) and not chat.detach:
            await cancel_quietly(client, admitted.request_id, "client_left")

    async def admit(self, scope, receive):
        if scope["method"] != "POST":
            raise ApiError(405, "Use POST for /v1/chat/completions.", code="method_not_allowed")
        owner = await database_sync_to_async(required_owner)(header(scope, b"authorization"))
        chat = chat_request.parse(await read_body(scope, receive), header(scope, b"content-type"), backends.CATALOG)
        return chat, await sync_to_async(admit_in_pool, thread_sensitive=False)(chat, owner)


async def cancel_quietly(client, request_id, by):
    """Stop a request nobody reads any more; with Redis down, its worker stops on its own (the
    state it checks every step is gone too)."""
    try:
        await streamlog.cancel(client, request_id, by)
    except Exception:
        log.warning("could not cancel request %s", request_id, exc_info=True)


def admit_in_pool(chat, owner):
    """Admission in a pool thread (tokenizing must not hold up other requests); its database
    connection (the budget holds) is checked before use and closed after, as a request's is."""
    close_old_connections()
    try:
        return admit(chat, owner)
    finally:
        close_old_connections()


class CompletionEvents(StreamingApp):
    """GET /v1/chat/completions/{id}/events: the same stream, replayable with Last-Event-ID.

    For EventSource (session) and API keys alike; leaving does not cancel, so a dropped
    connection can come back and continue where it stopped.
    """

    async def serve(self, scope, receive, response):
        request_id = scope["url_route"]["kwargs"]["request_id"]
        client = streamlog.async_client()
        try:
            owner, meta = await self.authorized_meta(scope, client, request_id)
            last_id = last_event_id(scope)
        except ApiError as exc:
            if exc.status == 404 and "text/event-stream" in header(scope, b"accept"):
                return await response.empty(204)  # expired or unknown: EventSource stops retrying
            return await response.error(exc)
        if last_id and await self.seen_the_end(client, request_id, last_id):
            # 204 tells EventSource to stop reconnecting: there is nothing more to send.
            return await response.empty(204)
        writer = resumed_writer(meta.admitted(request_id), meta, owner, resumed=bool(last_id))
        readers_left, _ = await follow(receive, send_sse(response, client, writer, writer.admitted, last_id), client, request_id)
        if readers_left == 0:
            cancel_unless_followed(client, request_id)

    async def seen_the_end(self, client, request_id, last_event_id):
        """True when the request ended and this id is its last event or past it."""
        newest = await streamlog.last_entry(client, request_id)
        return newest is not None and isinstance(newest[1], End) and seen_past(last_event_id, newest[0])

    async def authorized_meta(self, scope, client, request_id):
        if scope["method"] != "GET":
            raise ApiError(405, "Use GET for the events of a request.", code="method_not_allowed")
        owner = await bearer_owner(scope) or await session_owner(scope)
        if owner is None:
            raise unauthorized()
        return owner, owned_meta(await streamlog.read_meta(client, request_id), owner, request_id)


def resumed_writer(admitted, meta, owner, resumed):
    """A key's reader gets the chunks the request asked for, so a resume continues the same
    stream; the chat page (a session) always gets the usage, live, and its place in line."""
    if owner.api_key_id is None:
        return ChunkWriter(admitted, include_usage=True, continuous_usage=True, resumed=resumed, places=True)
    return ChunkWriter(admitted, meta.include_usage, meta.continuous_usage, resumed=resumed)


def seen_past(last_event_id, end_id):
    """Whether a reader that saw `last_event_id` saw the end entry `end_id` whole, or more."""
    seen, _, part = last_event_id.partition(".")
    return (streamlog.entry_order(seen), not part) >= (streamlog.entry_order(end_id), True)


async def follow(receive, work, client, request_id):
    """Run `work` as one of the request's readers. Returns (None if it ran to its end, or, if
    the client left first, how many readers the request still has; what the work returned)."""
    await streamlog.add_reader(client, request_id, +1)
    readers = 0
    try:
        left, result = await until_disconnect(receive, work)
    finally:
        try:
            readers = await streamlog.add_reader(client, request_id, -1)
        except Exception:  # Redis is down: nobody can cancel anything now anyway
            log.warning("could not count a reader of %s leaving", request_id, exc_info=True)
    return (max(readers, 0) if left else None), result


_pending_cancels = set()


def cancel_unless_followed(client, request_id):
    """The last reader left: cancel the request unless one comes back within the grace period
    (a reload, or EventSource reconnecting after a network drop), so a closed tab stops it."""

    async def later():
        await asyncio.sleep(settings.TOKSTREAM_ABANDON_SECONDS)
        if int(await client.get(streamlog.key(request_id, "readers")) or 0) <= 0:
            await streamlog.cancel(client, request_id, "abandoned")

    task = asyncio.get_running_loop().create_task(later())
    _pending_cancels.add(task)  # the loop keeps only a weak reference to its tasks
    task.add_done_callback(_pending_cancels.discard)


def last_event_id(scope):
    """Last-Event-ID from the header, or the query for clients that cannot set headers."""
    value = header(scope, b"last-event-id") or query(scope, "last_event_id")
    if value and not valid_event_id(value):
        raise invalid(f"Last-Event-ID {value!r} is not an id this stream sent.", param="last_event_id")
    return value


def query(scope, name):
    values = parse_qs(scope.get("query_string", b"").decode()).get(name)
    return values[0] if values else ""
