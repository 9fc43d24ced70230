"""The streaming endpoints, as plain ASGI apps under Channels.

A Channels consumer cannot see http.disconnect while it streams (channels#1249), so each
response is sent from a task while this coroutine keeps reading receive(): a client that leaves
is noticed at once, and its request is cancelled.
"""

import asyncio
import json
import logging
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import close_old_connections

from billing.models import ApiKey

from . import chat_request, reaper, streamlog
from .admission import Admitted, Owner, admit, owned_meta
from .chunks import EVENT_ID, ChunkWriter, completion, resume_point, sse_frames
from .errors import ApiError, forbidden, invalid, too_large, unauthorized

log = logging.getLogger(__name__)


class ClientGone(Exception):
    pass


# A comment line alone, without the blank line that ends an event: once a stream has sent an
# id, the openai SDK turns any blank line into an event and fails on its empty data.
KEEPALIVE = b": keep-alive\n"


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


async def send_json(send, status, payload, headers=()):
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send, exc):
    headers = [(name.lower().encode(), value.encode()) for name, value in exc.headers.items()]
    await send_json(send, exc.status, exc.body(), headers)


async def send_empty(send, status):
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


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
    key = await database_sync_to_async(ApiKey.from_authorization)(header(scope, b"authorization"))
    if key is not None and not key.has_scope("chat"):
        raise forbidden("chat")
    return Owner.of_key(key) if key else None


async def session_owner(scope):
    user = scope.get("user")
    if user is None or not await database_sync_to_async(lambda: user.is_authenticated)():
        return None
    return Owner(user_id=user.pk)


async def wait_for_disconnect(receive):
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive, work):
    """Run `work` while watching for the client leaving; True if the client left first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    left = task not in done
    (task if left else watcher).cancel()
    if not left:
        task.result()  # re-raise what the work raised
    return left


async def entries(client, admitted, last_id, on_idle=None):
    """Yield (id, entry) from the log after last_id until the end entry, live.

    While the log is idle, check that someone will write it: the worker that claimed the
    request must be beating; an unclaimed request needs a live worker for its model two idle
    intervals in a row (one could be a worker restarting). Otherwise the request is ended here
    (inference.reaper), and the end entry that writes is read like any other.
    """
    block_ms = settings.TOKSTREAM_KEEPALIVE_SECONDS * 1000
    orphaned = 0
    while True:
        batch = await streamlog.read_after(client, admitted.request_id, last_id, block_ms)
        if batch and settings.TOKSTREAM_COALESCE_MS:
            batch = await coalesced(client, admitted.request_id, batch)
        if not batch:
            orphaned = await orphan_count(client, admitted, orphaned)
            if orphaned >= 2:
                await database_sync_to_async(reaper.end_abandoned)(admitted.request_id, abandoned_message(admitted))
            elif on_idle:
                await on_idle()
        for last_id, entry in batch:
            yield last_id, entry
            if entry["t"] == "end":
                return


async def coalesced(client, request_id, batch):
    """What else arrives within the window, with runs of plain deltas of one choice merged into
    one (whole entries only: no character is split, nothing reordered). The merged event keeps
    the id of its last entry, so a resume from it continues exactly after it."""
    await asyncio.sleep(settings.TOKSTREAM_COALESCE_MS / 1000)
    batch += await streamlog.read_after(client, request_id, batch[-1][0], None)
    merged = []
    for entry_id, entry in batch:
        previous = merged[-1][1] if merged else None
        if mergeable(previous, entry):
            merged[-1] = (entry_id, {**entry, "text": previous["text"] + entry["text"]})
        else:
            merged.append((entry_id, entry))
    return merged


def mergeable(previous, entry):
    def plain(e):
        return e is not None and e["t"] == "delta" and "logprobs" not in e

    return plain(previous) and plain(entry) and previous.get("i", 0) == entry.get("i", 0)


async def orphan_count(client, admitted, orphaned):
    """0 while the request has a live worker; a dead claimed worker counts double."""
    beats = await streamlog.workers(client)
    worker = await client.hget(streamlog.key(admitted.request_id, "meta"), "worker")
    if worker:
        return 0 if streamlog.beating(beats, worker, admitted.model) else 2
    return 0 if admitted.model in streamlog.served_models(beats) else orphaned + 1


def abandoned_message(admitted):
    return f"The worker serving `{admitted.model}` stopped answering; the request was abandoned."


async def relay_sse(send, client, writer, admitted, last_event_id=""):
    async def body(data):
        await send({"type": "http.response.body", "body": data, "more_body": True})

    last_id, skip = resume_point(last_event_id) if last_event_id else ("0-0", 0)
    headers = [*SSE_HEADERS, (b"x-request-id", admitted.request_id.encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    retry = retry_hint()
    async for entry_id, entry in entries(client, admitted, last_id, on_idle=lambda: body(KEEPALIVE)):
        await body(retry + sse_frames(entry_id, writer.chunks(entry), done=entry["t"] == "end", skip=skip))
        retry, skip = b"", 0
    await send({"type": "http.response.body", "body": b""})


async def respond_whole(send, client, admitted):
    deltas = []
    try:
        async for _, entry in entries(client, admitted, "0-0"):
            if entry["t"] in ("delta", "tool", "args"):
                deltas.append(entry)
        await send_json(send, 200, completion(admitted, deltas, entry))
    except ApiError as exc:
        await send_error(send, exc)


class ChatCompletions:
    """POST /v1/chat/completions, streamed or whole; the client leaving cancels the request."""

    async def __call__(self, scope, receive, send):
        try:
            chat, admitted = await self.admit(scope, receive)
        except ApiError as exc:
            return await send_error(send, exc)
        except ClientGone:
            return
        except Exception:
            log.exception("admission failed")
            return await send_error(send, ApiError(500, "The server failed to accept the request.", type="server_error"))
        client = streamlog.async_client()
        if chat.stream:
            writer = ChunkWriter(admitted, chat.include_usage, chat.continuous_usage)
            work = relay_sse(send, client, writer, admitted)
        else:
            work = respond_whole(send, client, admitted)
        # Counted as a reader, so a resume elsewhere that ends does not cancel this stream.
        if await follow(receive, work, client, admitted.request_id) is not None and not chat.detach:
            await streamlog.cancel(client, admitted.request_id)

    async def admit(self, scope, receive):
        if scope["method"] != "POST":
            raise ApiError(405, "Use POST for /v1/chat/completions.", code="method_not_allowed")
        owner = await bearer_owner(scope)
        if owner is None:
            raise unauthorized()
        chat = chat_request.parse(await read_body(scope, receive), header(scope, b"content-type"))
        return chat, await sync_to_async(admit_in_pool, thread_sensitive=False)(chat, owner)


def admit_in_pool(chat, owner):
    """Admission in a pool thread (tokenizing must not hold up other requests); its database
    connection (the budget holds) is checked before use and closed after, as a request's is."""
    close_old_connections()
    try:
        return admit(chat, owner)
    finally:
        close_old_connections()


class CompletionEvents:
    """GET /v1/chat/completions/{id}/events: the same stream, replayable with Last-Event-ID.

    For EventSource (session) and API keys alike; leaving does not cancel, so a dropped
    connection can come back and continue where it stopped.
    """

    async def __call__(self, scope, receive, send):
        request_id = scope["url_route"]["kwargs"]["request_id"]
        client = streamlog.async_client()
        try:
            admitted = Admitted.from_meta(request_id, await self.authorized_meta(scope, client, request_id))
            last_id = last_event_id(scope)
        except ApiError as exc:
            if exc.status == 404 and "text/event-stream" in header(scope, b"accept"):
                return await send_empty(send, 204)  # expired or unknown: EventSource stops retrying
            return await send_error(send, exc)
        if last_id and await self.seen_the_end(client, request_id, last_id):
            # 204 tells EventSource to stop reconnecting: there is nothing more to send.
            return await send_empty(send, 204)
        writer = ChunkWriter(admitted, include_usage=True, continuous_usage=True, resumed=bool(last_id))
        readers_left = await follow(receive, relay_sse(send, client, writer, admitted, last_id), client, request_id)
        if readers_left == 0:
            cancel_unless_followed(client, request_id)

    async def seen_the_end(self, client, request_id, last_event_id):
        newest = await streamlog.last_entry(client, request_id)
        return newest is not None and newest[1]["t"] == "end" and newest[0] == last_event_id

    async def authorized_meta(self, scope, client, request_id):
        if scope["method"] != "GET":
            raise ApiError(405, "Use GET for the events of a request.", code="method_not_allowed")
        owner = await bearer_owner(scope) or await session_owner(scope)
        if owner is None:
            raise unauthorized()
        return owned_meta(await streamlog.load_meta(client, request_id), owner, request_id)


async def follow(receive, work, client, request_id):
    """Run `work` as one of the request's readers. Returns None if it ran to its end, or, if
    the client left first, how many readers the request still has."""
    await streamlog.add_reader(client, request_id, +1)
    try:
        left = await until_disconnect(receive, work)
    finally:
        readers = await streamlog.add_reader(client, request_id, -1)
    return max(readers, 0) if left else None


_pending_cancels = set()


def cancel_unless_followed(client, request_id):
    """The last reader left: cancel the request unless one comes back within the grace period
    (a reload, or EventSource reconnecting after a network drop), so a closed tab stops it."""

    async def later():
        await asyncio.sleep(settings.TOKSTREAM_ABANDON_SECONDS)
        if int(await client.get(streamlog.key(request_id, "readers")) or 0) <= 0:
            await streamlog.cancel(client, request_id)

    task = asyncio.get_running_loop().create_task(later())
    _pending_cancels.add(task)  # the loop keeps only a weak reference to its tasks
    task.add_done_callback(_pending_cancels.discard)


def last_event_id(scope):
    """Last-Event-ID from the header, or the query for clients that cannot set headers."""
    value = header(scope, b"last-event-id") or query(scope, "last_event_id")
    if value and not EVENT_ID.match(value):
        raise invalid(f"Last-Event-ID {value!r} is not an id this stream sent.", param="last_event_id")
    return value


def query(scope, name):
    values = parse_qs(scope.get("query_string", b"").decode()).get(name)
    return values[0] if values else ""
