"""The service's Redis keys: each request's delta log (a Stream), its metadata and cancel flag,
and the hash of live workers.

The log is the contract between the worker and the SSE endpoints: ordered, replayable by
entry id, bounded by MAXLEN and expiring TOKSTREAM_LOG_TTL seconds after its last entry (the
metadata expires with it).
"""

import asyncio
import functools
import json
import re
import time
import weakref

import redis
import redis.asyncio
from django.conf import settings

ENTRY_ID = re.compile(r"^\d+-\d+$")
_async_clients = weakref.WeakKeyDictionary()


def key(request_id, kind):
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:req:{request_id}:{kind}"


def workers_key():
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:workers"


@functools.cache
def _sync_client(url):
    return redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=2, socket_timeout=10)


def sync_client():
    """One thread-safe client (and connection pool) per process."""
    return _sync_client(settings.REDIS_URL)


def async_client():
    """One client per event loop: asyncio connections cannot cross loops. No read time-out,
    since XREAD blocks for up to the keep-alive interval."""
    loop = asyncio.get_running_loop()
    if loop not in _async_clients:
        _async_clients[loop] = redis.asyncio.Redis.from_url(settings.REDIS_URL, decode_responses=True, socket_connect_timeout=2)
    return _async_clients[loop]


def append(client, request_id, *entries):
    """Add entries (dicts) to the request's log in one round trip, and push its expiry, and its
    metadata's, forward; returns the id of the first."""
    log = key(request_id, "log")
    with client.pipeline(transaction=False) as pipe:
        for entry in entries:
            pipe.xadd(log, {"e": json.dumps(entry)}, maxlen=settings.TOKSTREAM_LOG_MAXLEN, approximate=True)
        pipe.expire(log, settings.TOKSTREAM_LOG_TTL)
        pipe.expire(key(request_id, "meta"), settings.TOKSTREAM_LOG_TTL)
        return pipe.execute()[0]


def decode_entries(entries):
    return [(entry_id, json.loads(fields["e"])) for entry_id, fields in entries]


def read_all(client, request_id):
    """Every (id, entry) of the log (sync client)."""
    return decode_entries(client.xrange(key(request_id, "log")))


def has_ended(client, request_id):
    """True once the request's end entry is in its log (sync client)."""
    newest = decode_entries(client.xrevrange(key(request_id, "log"), count=1))
    return bool(newest) and newest[0][1]["t"] == "end"


async def last_entry(client, request_id):
    """The newest (id, entry) of the log, or None while it is empty."""
    newest = decode_entries(await client.xrevrange(key(request_id, "log"), count=1))
    return newest[0] if newest else None


async def read_after(client, request_id, last_id, block_ms):
    """Entries after `last_id`, waiting up to block_ms for the first; [] on time-out."""
    reply = await client.xread({key(request_id, "log"): last_id}, block=block_ms)  # None: no wait
    return decode_entries(reply[0][1]) if reply else []


def save_meta(client, request_id, meta):
    meta_key = key(request_id, "meta")
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(meta_key, mapping=meta)
        # Until the first entry pushes it forward, it must outlive a wait in the queue.
        pipe.expire(meta_key, settings.TOKSTREAM_LOG_TTL + 3600)
        pipe.execute()


# These take the sync or the asyncio client; with the latter, await what they return.


def load_meta(client, request_id):
    return client.hgetall(key(request_id, "meta"))


def cancel(client, request_id):
    return client.set(key(request_id, "cancel"), "1", ex=settings.TOKSTREAM_LOG_TTL)


async def add_reader(client, request_id, delta):
    """Count the connections following a request's events (delta +1 or -1); returns the count."""
    readers = key(request_id, "readers")
    async with client.pipeline(transaction=True) as pipe:
        pipe.incrby(readers, delta)
        pipe.expire(readers, settings.TOKSTREAM_LOG_TTL)
        return (await pipe.execute())[0]


def steer(client, request_id, text):
    """Queue steering text, and raise the request's flag: the worker reads flags every step
    and lists only when flagged."""
    queue = key(request_id, "steer")
    with client.pipeline(transaction=True) as pipe:
        pipe.rpush(queue, text)
        pipe.expire(queue, settings.TOKSTREAM_LOG_TTL)
        pipe.set(key(request_id, "steered"), "1", ex=settings.TOKSTREAM_LOG_TTL)
        pipe.execute()


def signals_among(client, request_ids):
    """Which of these live requests were asked to stop, and the steering sent to each since
    the last look: one MGET per engine step, and a second round trip only when steered."""
    if not request_ids:
        return set(), {}
    flags = client.mget([key(r, kind) for r in request_ids for kind in ("cancel", "steered")])
    cancelled = {r for r, flag in zip(request_ids, flags[::2]) if flag}
    steered = [r for r, flag in zip(request_ids, flags[1::2]) if flag]
    return cancelled, take_steering(client, steered) if steered else {}


def take_steering(client, request_ids):
    with client.pipeline(transaction=True) as pipe:
        for request_id in request_ids:
            pipe.delete(key(request_id, "steered"))
            pipe.lrange(key(request_id, "steer"), 0, -1)
            pipe.delete(key(request_id, "steer"))
        replies = pipe.execute()
    return {r: texts for r, texts in zip(request_ids, replies[1::3]) if texts}


def heartbeat(client, worker_id, model, running=0, waiting=0):
    """Say that this engine serves `model` for the next TOKSTREAM_WORKER_TTL seconds (and how
    busy it is), and clear the beats of engines that stopped."""
    beats = workers(client)
    stale = [field for field, value in beats.items() if json.loads(value)["until"] < time.time()]
    beat = {"model": model, "until": time.time() + settings.TOKSTREAM_WORKER_TTL, "running": running, "waiting": waiting}
    with client.pipeline(transaction=False) as pipe:
        pipe.hset(workers_key(), f"{worker_id}:{model}", json.dumps(beat))
        if stale:
            pipe.hdel(workers_key(), *stale)
        pipe.execute()


def workers(client):
    """The raw heartbeats (sync or asyncio client); read them with served_models()."""
    return client.hgetall(workers_key())


def beating(beats, worker_id, model):
    beat = beats.get(f"{worker_id}:{model}")
    return beat is not None and json.loads(beat)["until"] >= time.time()


def live_beats(beats):
    now = time.time()
    return [beat for beat in map(json.loads, beats.values()) if beat["until"] >= now]


def served_models(beats):
    """Model name -> how many live engines serve it."""
    served = {}
    for beat in live_beats(beats):
        served[beat["model"]] = served.get(beat["model"], 0) + 1
    return served
