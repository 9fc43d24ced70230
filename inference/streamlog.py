"""The service's Redis keys: each request's delta log (a Stream), its metadata and cancel flag,
and the hash of live workers.

The log is the contract between the worker and the SSE endpoints: ordered, replayable by
entry id, bounded by MAXLEN and expiring TOKSTREAM_LOG_TTL seconds after its last entry (the
metadata expires with it).
"""

import asyncio
import dataclasses
import functools
import hashlib
import re
import time
import weakref

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from django.conf import settings
from redis.backoff import ExponentialWithJitterBackoff

from inference.protocol.entries import End, decode, encode
from inference.protocol.payloads import Beat, RequestMeta, State

ENTRY_ID = re.compile(r"^\d+-\d+$")
_async_clients = weakref.WeakKeyDictionary()


def key(request_id, kind):
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:req:{request_id}:{kind}"


def keyspace():
    """Names this Redis and key prefix (a database may serve several), without the URL's secrets."""
    return hashlib.sha256(f"{settings.REDIS_URL}|{settings.TOKSTREAM_REDIS_PREFIX}".encode()).hexdigest()[:16]


def workers_key():
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:workers"


# Every Redis call's time-out, from what it waits for. redis-py 8 gives a client a 5 s socket
# time-out unless told otherwise, which killed every XREAD BLOCK longer than that.
CONNECT_TIMEOUT = 2  # seconds to open a connection
CALL_TIMEOUT = 5  # any call that does not block on the server
BLOCK_MARGIN = 5  # a blocking read waits its block time, plus this for the round trip
RETRIES = 3  # a dropped connection is tried again, briefly: a Redis restart takes seconds
RETRY_WAIT = (0.05, 0.5)  # seconds before the first retry, and at most (doubling, with jitter)
HEALTH_CHECK_SECONDS = 30  # an idle pooled connection is pinged before use after this long
LOST_FROM_QUEUE = 3600  # seconds past the log's TTL after which a queue entry is a crash's leftover


def client_options(block_seconds=0):
    """The options of a client whose longest call blocks `block_seconds` on the server."""
    return {
        "decode_responses": True,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "socket_timeout": block_seconds + BLOCK_MARGIN if block_seconds else CALL_TIMEOUT,
        "health_check_interval": HEALTH_CHECK_SECONDS,
    }


def _retry(kind):
    # Not on a time-out: a call that timed out would wait its whole time-out again.
    return kind.Retry(ExponentialWithJitterBackoff(base=RETRY_WAIT[0], cap=RETRY_WAIT[1]), RETRIES, supported_errors=(redis.ConnectionError,))


@functools.cache
def _sync_client(url):
    return redis.Redis.from_url(url, retry=_retry(redis.retry), **client_options())


def sync_client():
    """One thread-safe client (and connection pool) per process."""
    return _sync_client(settings.REDIS_URL)


def async_client(block_seconds=0):
    """One client per event loop and time-out (asyncio connections cannot cross loops); a
    reader that blocks passes how long it blocks at most."""
    clients = _async_clients.setdefault(asyncio.get_running_loop(), {})
    if block_seconds not in clients:
        clients[block_seconds] = redis.asyncio.Redis.from_url(settings.REDIS_URL, retry=_retry(redis.asyncio.retry), **client_options(block_seconds))
    return clients[block_seconds]


def blocking_client():
    """The client for XREAD BLOCK, which waits up to the keep-alive interval."""
    return async_client(settings.TOKSTREAM_KEEPALIVE_SECONDS)


def append(client, request_id, *entries):
    """Add entries (inference.protocol.entries) to the request's log in one round trip, and push its expiry, and its
    metadata's, forward; returns the id of the first."""
    with client.pipeline(transaction=False) as pipe:
        queue_entries(pipe, request_id, entries, push_expiry=True)
        return pipe.execute()[0]


def append_each(client, logs):
    """Several requests' entries in one round trip: `logs` holds (request id, entries, whether
    to push its expiry forward) for each; -> for each, the error Redis answered, or None. One
    log that refuses its entries (a key of another type, say) fails alone; a lost connection
    raises. A log written many times a second need not push its expiry every time:
    TOKSTREAM_LOG_TTL is minutes, and its end entry pushes it again."""
    with client.pipeline(transaction=False) as pipe:
        sizes = [queue_entries(pipe, request_id, entries, push_expiry) for request_id, entries, push_expiry in logs]
        replies = pipe.execute(raise_on_error=False)
    errors, start = [], 0
    for size in sizes:
        errors.append(next((r for r in replies[start : start + size] if isinstance(r, Exception)), None))
        start += size
    return errors


def queue_entries(pipe, request_id, entries, push_expiry):
    """-> how many commands it queued."""
    log = key(request_id, "log")
    for entry in entries:
        pipe.xadd(log, {"e": encode(entry)}, maxlen=settings.TOKSTREAM_LOG_MAXLEN, approximate=True)
    if not push_expiry:
        return len(entries)
    # Never shorter: a queued request's keys must outlive its wait (see admit).
    for kind in ("log", "meta", "state"):
        pipe.expire(key(request_id, kind), settings.TOKSTREAM_LOG_TTL, gt=True)
    return len(entries) + 3


def entry_order(entry_id):
    """An entry id as something that sorts in the log's order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def decode_entries(entries):
    """(id, entry) of each entry this version knows (a newer writer's new kinds are skipped)."""
    decoded = ((entry_id, decode(fields["e"])) for entry_id, fields in entries)
    return [(entry_id, entry) for entry_id, entry in decoded if entry is not None]


def read_all(client, request_id):
    """Every (id, entry) of the log (sync client)."""
    return decode_entries(client.xrange(key(request_id, "log")))


def end_of(client, request_id):
    """The request's end entry, once it is in its log; else None (sync client)."""
    newest = decode_entries(client.xrevrange(key(request_id, "log"), count=1))
    return newest[0][1] if newest and isinstance(newest[0][1], End) else None


def has_ended(client, request_id):
    return end_of(client, request_id) is not None


async def last_entry(client, request_id):
    """The newest (id, entry) of the log, or None while it is empty."""
    newest = decode_entries(await client.xrevrange(key(request_id, "log"), count=1))
    return newest[0] if newest else None


def admit(client, request_id, meta, opening):
    """A new request's metadata (a RequestMeta), its state "queued" and its log's first entry,
    at once. They must outlive the longest wait in the queue, and then the log's TTL."""
    ttl = settings.TOKSTREAM_QUEUE_TIMEOUT + settings.TOKSTREAM_LOG_TTL
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(key(request_id, "meta"), mapping=meta.to_redis())
        pipe.expire(key(request_id, "meta"), ttl)
        pipe.set(key(request_id, "state"), State.QUEUED, ex=ttl)
        pipe.xadd(key(request_id, "log"), {"e": encode(opening)}, maxlen=settings.TOKSTREAM_LOG_MAXLEN, approximate=True)
        pipe.expire(key(request_id, "log"), ttl)
        pipe.execute()


def load_meta(client, request_id):
    """The request's RequestMeta, None once Redis no longer has it (sync client)."""
    return RequestMeta.from_redis(client.hgetall(key(request_id, "meta")))


async def read_meta(client, request_id):
    """load_meta, with the asyncio client."""
    return RequestMeta.from_redis(await client.hgetall(key(request_id, "meta")))


# These take the sync or the asyncio client; with the latter, await what they return.


# Who cancelled a request, as its cancel flag says and its ledger entry keeps (`error`).
CANCELLED_BY = {
    "user": "Stopped by its user.",
    "client_left": "Cancelled: its client closed the connection.",
    "abandoned": "Cancelled: nobody followed it for {abandon} s (its page was closed or away).",
    "ended_elsewhere": "Cancelled: it was ended while its worker still ran it.",
    "unsaved": "Cancelled: its chat could not be saved.",
}


def cancel(client, request_id, by="user"):
    """Set the request's cancel flag, saying who cancelled it (a key of CANCELLED_BY); the
    first to cancel is the one kept. Works with the sync or the asyncio client."""
    return client.set(key(request_id, "cancel"), by, ex=settings.TOKSTREAM_LOG_TTL, nx=True)


def cancelled_by(client, request_id):
    """Why the request was cancelled, as its ledger entry says it; "" when nobody cancelled it."""
    return CANCELLED_BY.get(client.get(key(request_id, "cancel")) or "", "").format(abandon=settings.TOKSTREAM_ABANDON_SECONDS)


async def add_reader(client, request_id, delta):
    """Count the connections following a request's events (delta +1 or -1); returns the count."""
    readers = key(request_id, "readers")
    async with client.pipeline(transaction=True) as pipe:
        pipe.incrby(readers, delta)
        pipe.expire(readers, settings.TOKSTREAM_LOG_TTL)
        return (await pipe.execute())[0]


def steer(client, request_id, text):
    """Queue steering text, and raise the request's flag: the worker reads the flags every 50 ms
    and lists only when flagged."""
    queue = key(request_id, "steer")
    with client.pipeline(transaction=True) as pipe:
        pipe.rpush(queue, text)
        pipe.expire(queue, settings.TOKSTREAM_LOG_TTL)
        pipe.set(key(request_id, "steered"), "1", ex=settings.TOKSTREAM_LOG_TTL)
        pipe.execute()


def signals_among(client, request_ids):
    """Which of these live requests were asked to stop, the steering sent to each since the
    last look, and each one's state: one MGET per engine step, and a second round trip only
    when steered."""
    if not request_ids:
        return set(), {}, {}
    kinds = ("cancel", "steered", "state")
    flags = client.mget([key(r, kind) for r in request_ids for kind in kinds])
    cancelled = {r for r, flag in zip(request_ids, flags[::3]) if flag}
    steered = [r for r, flag in zip(request_ids, flags[1::3]) if flag]
    states = dict(zip(request_ids, flags[2::3]))
    return cancelled, take_steering(client, steered) if steered else {}, states


def take_steering(client, request_ids):
    with client.pipeline(transaction=True) as pipe:
        for request_id in request_ids:
            pipe.delete(key(request_id, "steered"))
            pipe.lrange(key(request_id, "steer"), 0, -1)
            pipe.delete(key(request_id, "steer"))
        replies = pipe.execute()
    return {r: texts for r, texts in zip(request_ids, replies[1::3]) if texts}


def heartbeat(client, worker_id, model, running=0, waiting=0, draining=False):
    """Say that this engine serves `model` for the next TOKSTREAM_WORKER_TTL seconds (and how
    busy it is, and whether it is draining: finishing what it runs, taking nothing new), and
    clear the beats of engines that stopped."""
    now = time.time()
    stale = [field for field, beat in workers(client).items() if not beat.live(now)]
    beat = Beat(model, now + settings.TOKSTREAM_WORKER_TTL, running, waiting, draining)
    with client.pipeline(transaction=False) as pipe:
        pipe.hset(workers_key(), f"{worker_id}:{model}", beat.to_redis())
        if stale:
            pipe.hdel(workers_key(), *stale)
        pipe.execute()


def forget_workers(client, gone):
    """Remove the beats whose field (`host:pid:boot:device:model`) `gone` says are of workers
    that stopped, so nothing counts them live for the rest of their TTL."""
    fields = [field for field in workers(client) if gone(field)]
    if fields:
        client.hdel(workers_key(), *fields)
    return fields


def drain_workers(client, mine):
    """Mark the beats whose field `mine` says are this worker's as draining, at once: the
    worker's next beat may be seconds away, and admission must stop sending it work now."""
    beats = {field: beat for field, beat in workers(client).items() if mine(field)}
    if beats:
        client.hset(workers_key(), mapping={field: dataclasses.replace(beat, draining=True).to_redis() for field, beat in beats.items()})
    return list(beats)


def workers(client):
    """The heartbeats, {field: Beat} (sync client)."""
    return beats_of(client.hgetall(workers_key()))


def beats_of(fields):
    """The workers hash, as read (by a pipeline, say), made Beats."""
    return {field: Beat.from_redis(text) for field, text in fields.items()}


def beating(beats, worker_id, model, now=None):
    beat = beats.get(f"{worker_id}:{model}")
    return beat is not None and beat.live(now or time.time())


def live_beats(beats):
    now = time.time()
    return [beat for beat in beats.values() if beat.live(now)]


def served_models(beats, draining=False):
    """Model name -> how many live engines take new requests of it (with `draining`: how many
    finish what they run and take nothing new)."""
    served = {}
    for beat in live_beats(beats):
        if beat.draining == draining:
            served[beat.model] = served.get(beat.model, 0) + 1
    return served


def queue_key(model):
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:queued:{model}"


def join_queue(client, model, request_id):
    """Place the request in its model's queue; returns its position (0: next)."""
    now, key = time.time(), queue_key(model)
    with client.pipeline(transaction=True) as pipe:
        pipe.zremrangebyscore(key, 0, now - settings.TOKSTREAM_LOG_TTL - LOST_FROM_QUEUE)
        pipe.zadd(key, {request_id: now})
        pipe.zrank(key, request_id)
        return pipe.execute()[-1]


def leave_queue(client, model, request_id):
    client.zrem(queue_key(model), request_id)
