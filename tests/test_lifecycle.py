"""A request's life in Redis, one transition at a time: claims are atomic, an ending is
written once, and a queued request's keys outlive its wait."""

import json
import time
import uuid

import pytest
from django.conf import settings

from inference import lifecycle, streamlog
from inference.protocol.entries import Delta, End, Open

MODEL = "a-model"


@pytest.fixture
def queued(redis_client):
    request_id = f"chatcmpl-life-{uuid.uuid4().hex}"
    meta = {"owner": "key:1", "model": MODEL, "created": 0, "prompt_tokens": 3, "n": 1, "received_at": time.time(), "deadline": time.time() + 600}
    streamlog.admit(redis_client, request_id, meta, Open(1, 0))
    return request_id


def beat(client, worker, until):
    client.hset(streamlog.workers_key(), f"{worker}:{MODEL}", json.dumps({"model": MODEL, "until": until}))


def claim(client, request_id, worker="w1"):
    return lifecycle.claim(client, request_id, MODEL, worker)


def test_it_claims_a_queued_request_once(redis_client, queued):
    beat(redis_client, "w1", time.time() + 60)
    assert claim(redis_client, queued) == "claimed"
    assert redis_client.get(lifecycle.state_key(queued)) == "running w1"
    assert claim(redis_client, queued, "w2") == "running"  # a second delivery while it runs


def test_a_claim_takes_over_from_a_dead_worker_to_end_it(redis_client, queued):
    beat(redis_client, "dead", time.time() - 1)
    assert claim(redis_client, queued, "dead") == "claimed"
    assert claim(redis_client, queued, "w2") == "orphaned"
    assert claim(redis_client, queued, "w3") == "ended"  # the one that took over ends it


def test_a_cancelled_expired_or_unknown_request_is_never_run(redis_client, queued):
    streamlog.cancel(redis_client, queued)
    assert claim(redis_client, queued) == "cancelled"
    late = f"{queued}-late"
    streamlog.admit(redis_client, late, {"model": MODEL, "deadline": time.time() - 1}, Open(1, 0))
    assert claim(redis_client, late) == "expired"
    assert claim(redis_client, f"{queued}-never-admitted") == "lost"


def test_an_ending_is_published_once(redis_client, queued):
    assert lifecycle.publish_end(redis_client, queued, End(["stop"], {})) == 1
    assert lifecycle.publish_end(redis_client, queued, End(["error"], {})) == 0
    assert [e.t for _, e in streamlog.read_all(redis_client, queued)] == ["open", "end"]
    assert claim(redis_client, queued) == "ended"


def test_a_take_over_needs_the_state_it_saw(redis_client, queued):
    assert not lifecycle.take_over(redis_client, queued, "running w1")
    assert lifecycle.take_over(redis_client, queued, "queued")
    assert not lifecycle.take_over(redis_client, queued, "queued")  # someone else was first
    assert lifecycle.take_over(redis_client, f"{queued}-gone", None)


def test_a_prefetching_worker_is_named_only_while_queued(redis_client, queued):
    lifecycle.reserve(redis_client, queued, "w1")
    assert redis_client.hget(streamlog.key(queued, "meta"), "worker") == "w1"
    beat(redis_client, "w2", time.time() + 60)
    claim(redis_client, queued, "w2")
    lifecycle.reserve(redis_client, queued, "w3")
    assert redis_client.hget(streamlog.key(queued, "meta"), "worker") == "w2"


def test_a_queued_requests_keys_outlive_its_wait(redis_client, queued):
    streamlog.append(redis_client, queued, Delta("x", 1))
    for kind in ("meta", "state", "log"):
        assert redis_client.ttl(streamlog.key(queued, kind)) > settings.TOKSTREAM_QUEUE_TIMEOUT


def test_redis_calls_wait_no_longer_than_what_they_wait_for():
    assert streamlog.client_options()["socket_timeout"] == streamlog.CALL_TIMEOUT
    blocking = streamlog.client_options(settings.TOKSTREAM_KEEPALIVE_SECONDS)
    assert blocking["socket_timeout"] == settings.TOKSTREAM_KEEPALIVE_SECONDS + streamlog.BLOCK_MARGIN


def test_a_claim_tried_again_after_its_reply_was_lost_still_holds(redis_client, queued):
    beat(redis_client, "w1", time.time() + 60)
    keys = [lifecycle.state_key(queued), streamlog.key(queued, "cancel"), streamlog.key(queued, "meta"), "unused-queue", streamlog.workers_key()]
    again = [redis_client.eval(lifecycle.CLAIM, len(keys), *keys, "w1", time.time(), queued, MODEL, "token-1") for _ in range(2)]
    assert again == ["claimed", "claimed"]
    assert claim(redis_client, queued, "w1") == "running"  # another delivery, even to the same worker


def test_the_sweeper_leaves_a_fresh_ending_to_its_ender(redis_client):
    now = time.time()
    assert lifecycle.stale(MODEL, lifecycle.ENDING, None, None, now - 1, {}) is None
    assert lifecycle.stale(MODEL, lifecycle.ENDING, None, None, now - lifecycle.SWEEP_AFTER - 1, {}) == "orphaned"
    assert lifecycle.stale(MODEL, None, None, None, None, {}) == "lost"
    assert lifecycle.stale(MODEL, lifecycle.ENDED, None, None, None, {}) == lifecycle.ENDED
    assert lifecycle.stale(MODEL, "queued", None, now - 1, None, {}) == "expired"
    assert lifecycle.stale(MODEL, "running dead", None, now + 60, None, {}) == "orphaned"


def test_a_requests_status_is_the_worst_of_its_choices():
    assert lifecycle.worst(["stop", "length"]) == "length"
    assert lifecycle.worst(["stop", "error", "cancelled"]) == "error"
