"""How many requests one upstream server is sent at once, across every worker: a semaphore in
Redis, taken in arrival order.

A holder's lease is renewed while it relays, so the slots of a worker that died come free when
their leases run out; a waiter that died leaves the line once it stops asking. A single-slot
server (llama.cpp's) never sees two requests, so none interrupts another.
"""

import time

from django.conf import settings

LEASE_SECONDS = 30
RENEW_SECONDS = 5
ASK_SECONDS = 0.1
GONE_SECONDS = 5  # a waiter that has not asked for this long died
KEY_SECONDS = 86400  # the keys outlive any request; an unused upstream's go away

# KEYS: holders (member -> lease end), waiting (member -> arrival), asked (member -> last ask).
# ARGV: member, now, lease end, limit, arrival.
ACQUIRE = f"""
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - {GONE_SECONDS})) do
  redis.call('ZREM', KEYS[2], member)
  redis.call('ZREM', KEYS[3], member)
end
redis.call('ZADD', KEYS[2], 'NX', ARGV[5], ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[1])
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, {KEY_SECONDS}) end
if redis.call('ZRANK', KEYS[2], ARGV[1]) < tonumber(ARGV[4]) - redis.call('ZCARD', KEYS[1]) then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  return 1
end
return 0
"""


def keys(server):
    base = f"{settings.TOKSTREAM_REDIS_PREFIX}:upstream:{server}"
    return [f"{base}:holders", f"{base}:waiting", f"{base}:asked"]


class Slot:
    """One request's place at one upstream server (`server`: what its limit counts, see
    upstream.slots_of)."""

    def __init__(self, client, server, request_id, limit, arrival):
        self.client, self.keys = client, keys(server)
        self.request_id, self.limit, self.arrival = request_id, limit, arrival
        self.renewed = 0.0

    def wait(self, unwanted):
        """Wait for a slot: True once held; False as soon as `unwanted()` is true."""
        while not self.try_acquire():
            if unwanted():
                self.release()
                return False
            time.sleep(ASK_SECONDS)
        self.renewed = time.monotonic()
        return True

    def try_acquire(self):
        now = time.time()
        return bool(self.client.eval(ACQUIRE, len(self.keys), *self.keys, self.request_id, now, now + LEASE_SECONDS, self.limit, self.arrival))

    def renew(self):
        """Keep the lease while relaying; called often, it writes every few seconds."""
        if time.monotonic() - self.renewed >= RENEW_SECONDS:
            self.client.zadd(self.keys[0], {self.request_id: time.time() + LEASE_SECONDS}, xx=True)
            self.renewed = time.monotonic()

    def release(self):
        with self.client.pipeline(transaction=False) as pipe:
            for key in self.keys:
                pipe.zrem(key, self.request_id)
            pipe.execute()
