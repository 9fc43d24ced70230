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

from billing.models import ApiKey

from . import chat_request, streamlog
from .admission import Admitted, Owner, admit
from .chunks import ChunkWriter, completion, resume_point, sse_frames
from .errors import ApiError, not_found, unauthorized

log = logging.getLogger(__name__)


class ClientGone(Exception):
    pass


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


async def send_empty(send, status):
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def read_body(scope, receive):
    limit = settings.TOKSTREAM_MAX_BODY_BYTES
    too_large = ApiError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")
    if header(scope, b"content-length").isdigit() and int(header(scope, b"content-length")) > limit:
        raise too_large
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body += message.get("body", b"")
        if len(body) > limit:
            raise too_large
        if not message.get("more_body"):
            return bytes(body)


async def bearer_owner(scope):
    auth = header(scope, b"authorization")
    if not auth.startswith("Bearer "):
        return None
    key = await database_sync_to_async(ApiKey.authenticate)(auth.removeprefix("Bearer ").strip())
    return Owner(api_key_id=key.pk, user_id=key.user_id) if key else None


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


async def entries(client, request_id, last_id, on_idle=None):
    """Yield (id, entry) from the log after last_id until the end entry, live."""
    block_ms = settings.TOKSTREAM_KEEPALIVE_SECONDS * 1000
    while True:
        batch = await streamlog.read_after(client, request_id, last_id, block_ms)
        if not batch and on_idle:
            await on_idle()
        for last_id, entry in batch:
            yield last_id, entry
            if entry["t"] == "end":
                return


async def relay_sse(send, client, writer, request_id, last_event_id=""):
    async def body(data):
        await send({"type": "http.response.body", "body": data, "more_body": True})

    last_id, skip = resume_point(last_event_id) if last_event_id else ("0-0", 0)
    await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, (b"x-request-id", request_id.encode())]})
    await body(b"retry: 3000\n\n")
    async for entry_id, entry in entries(client, request_id, last_id, on_idle=lambda: body(b": keep-alive\n\n")):
        await body(sse_frames(entry_id, writer.chunks(entry), done=entry["t"] == "end", skip=skip))
        skip = 0
    await send({"type": "http.response.body", "body": b""})


async def respond_whole(send, client, admitted):
    text = []
    async for _, entry in entries(client, admitted.request_id, "0-0"):
        if entry["t"] == "delta":
            text.append(entry["text"])
    try:
        await send_json(send, 200, completion(admitted, "".join(text), entry))
    except ApiError as exc:
        await send_json(send, exc.status, exc.body())


class ChatCompletions:
    """POST /v1/chat/completions, streamed or whole; the client leaving cancels the request."""

    async def __call__(self, scope, receive, send):
        try:
            chat, admitted = await self.admit(scope, receive)
        except ApiError as exc:
            return await send_json(send, exc.status, exc.body())
        except ClientGone:
            return
        except Exception:
            log.exception("admission failed")
            error = ApiError(500, "The server failed to accept the request.", type="server_error")
            return await send_json(send, error.status, error.body())
        async with streamlog.async_client() as client:
            if chat.stream:
                writer = ChunkWriter(admitted, chat.include_usage, chat.continuous_usage)
                work = relay_sse(send, client, writer, admitted.request_id)
            else:
                work = respond_whole(send, client, admitted)
            if await until_disconnect(receive, work):
                await streamlog.cancel(client, admitted.request_id)

    async def admit(self, scope, receive):
        if scope["method"] != "POST":
            raise ApiError(405, "Use POST for /v1/chat/completions.", code="method_not_allowed")
        owner = await bearer_owner(scope)
        if owner is None:
            raise unauthorized()
        chat = chat_request.parse(await read_body(scope, receive), header(scope, b"content-type"))
        return chat, await sync_to_async(admit, thread_sensitive=False)(chat, owner)


class CompletionEvents:
    """GET /v1/chat/completions/{id}/events: the same stream, replayable with Last-Event-ID.

    For EventSource (session) and API keys alike; leaving does not cancel, so a dropped
    connection can come back and continue where it stopped.
    """

    async def __call__(self, scope, receive, send):
        request_id = scope["url_route"]["kwargs"]["request_id"]
        try:
            meta = await self.authorized_meta(scope, request_id)
        except ApiError as exc:
            return await send_json(send, exc.status, exc.body())
        last_id = header(scope, b"last-event-id") or query(scope, "last_event_id")
        admitted = Admitted.from_meta(request_id, meta)
        writer = ChunkWriter(admitted, include_usage=True, continuous_usage=True, resumed=bool(last_id))
        async with streamlog.async_client() as client:
            if last_id and await self.seen_the_end(client, request_id, last_id):
                # 204 tells EventSource to stop reconnecting: there is nothing more to send.
                return await send_empty(send, 204)
            await until_disconnect(receive, relay_sse(send, client, writer, request_id, last_id))

    async def seen_the_end(self, client, request_id, last_event_id):
        newest = await streamlog.last_entry(client, request_id)
        return newest is not None and newest[1]["t"] == "end" and newest[0] == last_event_id

    async def authorized_meta(self, scope, request_id):
        if scope["method"] != "GET":
            raise ApiError(405, "Use GET for the events of a request.", code="method_not_allowed")
        owner = await bearer_owner(scope) or await session_owner(scope)
        if owner is None:
            raise unauthorized()
        async with streamlog.async_client() as client:
            meta = await streamlog.load_meta(client, request_id)
        if not meta or meta["owner"] != owner.label:
            raise not_found(f"No request {request_id!r} is known.", param="id")
        return meta


def query(scope, name):
    values = parse_qs(scope.get("query_string", b"").decode()).get(name)
    return values[0] if values else ""
