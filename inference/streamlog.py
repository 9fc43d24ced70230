"""The per-request Redis keys: the delta log (a Stream), its metadata, and the cancel flag.

The log is the contract between the worker and the SSE endpoints: ordered, replayable by
entry id, bounded by MAXLEN and expiring TOKSTREAM_LOG_TTL seconds after its last entry.
"""

import json

import redis
import redis.asyncio
from django.conf import settings


def key(request_id, kind):
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:req:{request_id}:{kind}"


def worker_key(hostname):
    return f"{settings.TOKSTREAM_REDIS_PREFIX}:worker:{hostname}"


def sync_client():
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


def async_client():
    return redis.asyncio.Redis.from_url(settings.REDIS_URL, decode_responses=True)


def append(client, request_id, entry):
    """Add one entry (a dict) to the request's log and push its expiry forward."""
    log = key(request_id, "log")
    with client.pipeline(transaction=False) as pipe:
        pipe.xadd(log, {"e": json.dumps(entry)}, maxlen=settings.TOKSTREAM_LOG_MAXLEN, approximate=True)
        pipe.expire(log, settings.TOKSTREAM_LOG_TTL)
        return pipe.execute()[0]


def decode_entries(entries):
    return [(entry_id, json.loads(fields["e"])) for entry_id, fields in entries]


async def last_entry(client, request_id):
    """The newest (id, entry) of the log, or None while it is empty."""
    newest = decode_entries(await client.xrevrange(key(request_id, "log"), count=1))
    return newest[0] if newest else None


async def read_after(client, request_id, last_id, block_ms):
    """Entries after `last_id`, waiting up to block_ms for the first; [] on time-out."""
    reply = await client.xread({key(request_id, "log"): last_id}, block=block_ms)
    return decode_entries(reply[0][1]) if reply else []


def save_meta(client, request_id, meta):
    meta_key = key(request_id, "meta")
    with client.pipeline(transaction=True) as pipe:
        pipe.hset(meta_key, mapping=meta)
        # Outlives the log: a request may wait in the queue before its first entry.
        pipe.expire(meta_key, settings.TOKSTREAM_LOG_TTL + 3600)
        pipe.execute()


# The two below take the sync or the asyncio client; with the latter, await what they return.


def load_meta(client, request_id):
    return client.hgetall(key(request_id, "meta"))


def cancel(client, request_id):
    return client.set(key(request_id, "cancel"), "1", ex=settings.TOKSTREAM_LOG_TTL)


def cancelled_among(client, request_ids):
    """Which of these running requests were asked to stop: one round trip per engine step."""
    if not request_ids:
        return set()
    flags = client.mget([key(r, "cancel") for r in request_ids])
    return {r for r, flag in zip(request_ids, flags) if flag}


def live_workers(client):
    """Workers whose heartbeat has not expired, each with the models it has loaded."""
    keys = list(client.scan_iter(match=worker_key("*"), count=100))
    return [json.loads(value) for value in client.mget(keys) if value] if keys else []
