"""The web process's one reader of the request logs (inference/gateway/tail.py), on real Redis:
every stream gets its own log's entries, in order, whenever it starts following; a log that
cannot be read fails its own streams and no other."""

import asyncio
import uuid

import pytest
import redis

from inference import streamlog
from inference.gateway import tail
from inference.protocol.entries import Delta, End

WAIT = 5  # seconds a follower waits for entries here: a third of the keep-alive interval


def new_request():
    return f"chatcmpl-{uuid.uuid4().hex}"


def texts(batch):
    return [entry.text for _, entry in batch if isinstance(entry, Delta)]


async def reading(logs, request_id):
    """Until the tail's read in flight names this request's log."""
    while streamlog.key(request_id, "log") not in logs.reading:
        await asyncio.sleep(0.01)


async def everything(follower):
    """What a follower is given until its log's end entry."""
    batch = []
    while not batch or not isinstance(batch[-1][1], End):
        more = await follower.next(WAIT)
        assert more, f"nothing came within {WAIT} s after {texts(batch)}"
        batch += more
    return batch


async def leave(logs, *followers):
    """As a stream does when it ends; the last to leave stops the tail's reads."""
    for follower in followers:
        await logs.leave(follower)
    if not logs.followers:
        await asyncio.wait_for(logs.task, WAIT)


def test_a_stream_that_starts_while_the_read_is_in_flight_gets_its_entries_at_once(redis_client):
    """The read in flight names only the logs followed before it was sent, and blocks for the
    keep-alive interval (15 s): a newcomer must not wait for it to time out."""
    first, second = new_request(), new_request()

    async def scenario():
        logs = tail.tail()
        waiting = await logs.follow(first, "0-0")
        await asyncio.wait_for(reading(logs, first), WAIT)
        newcomer = await logs.follow(second, "0-0")
        streamlog.append(redis_client, second, Delta("Hello", 1))
        got = await newcomer.next(WAIT)
        await leave(logs, waiting, newcomer)
        return got

    assert texts(asyncio.run(scenario())) == ["Hello"]


def test_each_stream_gets_its_own_log_in_order_from_where_it_started(redis_client):
    """Two logs written in turns, three streams: two from the start of their logs, one resuming
    the first log from its second entry."""
    one, two = new_request(), new_request()
    ids = [streamlog.append(redis_client, one, Delta("a0", 1)), streamlog.append(redis_client, one, Delta("a1", 2))]

    async def scenario():
        logs = tail.tail()
        followers = [await logs.follow(one, "0-0"), await logs.follow(two, "0-0"), await logs.follow(one, ids[1])]
        for n in range(2, 6):
            streamlog.append(redis_client, one, Delta(f"a{n}", n + 1))
            streamlog.append(redis_client, two, Delta(f"b{n}", n - 1))
            await asyncio.sleep(0)  # let the tail read some of them before the next are written
        streamlog.append(redis_client, one, End(["stop"]))
        streamlog.append(redis_client, two, End(["stop"]))
        got = [texts(await everything(f)) for f in followers]
        await leave(logs, *followers)
        return got

    assert asyncio.run(scenario()) == [[f"a{n}" for n in range(6)], [f"b{n}" for n in range(2, 6)], [f"a{n}" for n in range(2, 6)]]


def test_a_log_redis_cannot_read_fails_its_own_stream_and_no_other(redis_client):
    healthy, broken = new_request(), new_request()
    redis_client.set(streamlog.key(broken, "log"), "not a stream")

    async def scenario():
        logs = tail.tail()
        good, bad = await logs.follow(healthy, "0-0"), await logs.follow(broken, "0-0")
        with pytest.raises(redis.ResponseError):
            await bad.next(WAIT)
        await leave(logs, bad)
        streamlog.append(redis_client, healthy, Delta("still here", 1), End(["stop"]))
        got = texts(await everything(good))
        await leave(logs, good)
        return got

    assert asyncio.run(scenario()) == ["still here"]
