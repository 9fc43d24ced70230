"""One reader of the request logs per web process (per event loop): a single XREAD BLOCK over
every log its streams follow, each log's new entries handed to the streams that follow it.

Each stream used to block on an XREAD of its own. At 32 streams that was 32 round trips, 32
socket reads and 32 replies parsed in Daphne for every engine step, on the cores the worker's
forward pass needs (BENCHMARKS.md). Now a step costs one or two.

A read in flight names only the logs followed when it was sent: a new follower adds an entry
to this tail's wake-up stream, which that read also names, so it returns and the next read
names the new log too.
"""

import asyncio
import logging
import uuid
import weakref

import redis
from django.conf import settings

from inference import streamlog

log = logging.getLogger(__name__)
_tails = weakref.WeakKeyDictionary()
WAKE_TTL = 3600  # seconds: the wake-up stream of a process that died goes with it


def tail():
    """This event loop's tail (asyncio connections cannot cross loops)."""
    loop = asyncio.get_running_loop()
    if loop not in _tails:
        _tails[loop] = Tail()
    return _tails[loop]


class Follower:
    """One stream's view of a log: the entries read past its position, for it to take."""

    def __init__(self, request_id, last_id):
        self.log, self.last_id = streamlog.key(request_id, "log"), last_id
        self.ready, self.error, self.waiter = [], None, None

    def deliver(self, raw):
        """Entries of its log as XREAD gave them; those at or before its position are not news."""
        position = streamlog.entry_order(self.last_id)
        fresh = [item for item in raw if streamlog.entry_order(item[0]) > position]
        if fresh:
            self.last_id = fresh[-1][0]
            self.ready += streamlog.decode_entries(fresh)
            self.wake()

    def fail(self, exc):
        self.error = exc
        self.wake()

    def wake(self):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self, timeout):
        """The entries read since the last call, waiting up to `timeout` seconds for one; []
        when none came. Raises what the tail's read raised."""
        if not self.ready and self.error is None:
            loop = asyncio.get_running_loop()
            self.waiter = loop.create_future()
            timer = loop.call_later(timeout, self.wake)
            try:
                await self.waiter
            finally:
                timer.cancel()
                self.waiter = None
        return self.take()

    def take(self):
        """The entries read and not yet taken, without waiting; once they are all taken, the
        error that stopped the reads, if one did."""
        ready, self.ready = self.ready, []
        if not ready and self.error is not None:
            raise self.error
        return ready

    async def read_now(self, client):
        """Everything the log holds past this follower's position, read at once (the tail may
        not have read it yet), with what was read and not yet taken."""
        reply = await client.xread({self.log: self.last_id})
        if reply:
            self.deliver(reply[0][1])
        return self.take()


class Tail:
    def __init__(self):
        self.followers = {}  # log key -> the followers of that log
        self.wake_key = f"{settings.TOKSTREAM_REDIS_PREFIX}:tail:{uuid.uuid4().hex}"
        self.wake_id = "0-0"
        self.task = None
        self.reading = {}  # what the read in flight names: each log, and from where

    async def follow(self, request_id, last_id):
        follower = Follower(request_id, last_id)
        self.followers.setdefault(follower.log, set()).add(follower)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self.run())
        else:
            await self.wake_up()
        return follower

    async def leave(self, follower):
        group = self.followers.get(follower.log, set())
        group.discard(follower)
        if not group:
            self.followers.pop(follower.log, None)
        if not self.followers and self.task is not None and not self.task.done():
            # Its read returns and it stops: an idle process holds no read open. And it need
            # not be cancelled, which redis-py can swallow when it lands between two reads
            # (seen: asyncio.run's clean-up then waited out the next read's whole block).
            try:
                await self.wake_up()
            except Exception:  # Redis is down: the read fails, and the tail stops anyway
                log.debug("could not wake the tail", exc_info=True)

    async def wake_up(self):
        async with streamlog.async_client().pipeline(transaction=False) as pipe:
            pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1)
            pipe.expire(self.wake_key, WAKE_TTL)
            await pipe.execute()

    async def run(self):
        """Read every followed log until none is followed. A failed read fails their streams
        (each ends with an error its client can resume from); none is left waiting on a tail
        that stopped."""
        try:
            while self.followers:
                await self.read()
        except Exception as exc:
            self.fail_all(exc)
        finally:
            self.fail_all(ConnectionError("The reader of the request logs stopped."))

    async def read(self):
        self.reading = self.positions()
        try:
            reply = await streamlog.blocking_client().xread(self.reading, block=settings.TOKSTREAM_KEEPALIVE_SECONDS * 1000)
        except redis.ResponseError as exc:  # a key that is not a log: its followers fail, alone
            if not await self.fail_refused(exc):
                raise
            return
        for key, raw in reply or []:
            self.hand_out(key, raw)

    def positions(self):
        """Each followed log's earliest position among its followers, and the wake-up stream's."""
        positions = {log: min((f.last_id for f in group), key=streamlog.entry_order) for log, group in self.followers.items()}
        positions[self.wake_key] = self.wake_id
        return positions

    def hand_out(self, key, raw):
        if key == self.wake_key:
            self.wake_id = raw[-1][0]
            return
        for follower in list(self.followers.get(key, ())):
            follower.deliver(raw)

    async def fail_refused(self, exc):
        """Fail the followers of the logs Redis holds as another type; -> whether there were any."""
        keys = list(self.followers)
        async with streamlog.async_client().pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.type(key)
            kinds = await pipe.execute()
        refused = [key for key, kind in zip(keys, kinds) if kind not in ("stream", "none")]
        for key in refused:
            for follower in self.followers.pop(key, ()):
                follower.fail(exc)
        return bool(refused)

    def fail_all(self, exc):
        followers, self.followers = self.followers, {}
        for group in followers.values():
            for follower in group:
                follower.fail(exc)
