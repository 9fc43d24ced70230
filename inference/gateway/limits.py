"""Admission limits kept in Redis, so every web process sees the same counts: per-key rates
(requests and tokens per minute) and a bounded queue per model (the queue itself:
inference/streamlog.py)."""

import time

from django.conf import settings

from inference import streamlog
from inference.protocol.errors import too_many

# One fixed window a minute. Check both counters, then count, in one atomic step: concurrent
# requests cannot all slip under the limit.
RATE_SCRIPT = """
local requests = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) >= 0 and requests + 1 > tonumber(ARGV[1]) then return 1 end
if tonumber(ARGV[2]) >= 0 and tokens + tonumber(ARGV[3]) > tonumber(ARGV[2]) then return 2 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 120)
redis.call('INCRBY', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[2], 120)
return 0
"""


def check_rate(client, owner, tokens, now=None):
    """Count a request of `tokens` (prompt + max_tokens) against its key's limits, or refuse it.
    `now` (seconds since the epoch) is for tests that cross a minute without waiting for one."""
    if owner.requests_per_minute is None and owner.tokens_per_minute is None:
        return
    now = time.time() if now is None else now
    window = f"{settings.TOKSTREAM_REDIS_PREFIX}:rate:{owner.label}:{int(now // 60)}"
    limits = [-1 if limit is None else limit for limit in (owner.requests_per_minute, owner.tokens_per_minute)]
    refused = client.eval(RATE_SCRIPT, 2, f"{window}:requests", f"{window}:tokens", *limits, tokens)
    if refused:
        what, limit = ("requests", limits[0]) if refused == 1 else ("tokens", limits[1])
        message = f"Rate limit reached for {what} per minute (limit {limit}) on this key; try again in a minute."
        raise too_many(message, 60 - now % 60, type=what, code="rate_limit_exceeded")


def join_queue(client, model, request_id):
    """Place the request in its model's queue; returns its position (0: next), or refuses it
    when TOKSTREAM_MAX_QUEUED requests already wait."""
    position = streamlog.join_queue(client, model, request_id)
    if position >= settings.TOKSTREAM_MAX_QUEUED:
        streamlog.leave_queue(client, model, request_id)
        message = f"{position} requests for `{model}` are already waiting; try again shortly."
        raise too_many(message, 2, type="server_error", code="server_overloaded")
    return position
