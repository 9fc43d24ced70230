"""A request's life in Redis, one transition at a time: claims are atomic, an ending is
written once, and a queued request's keys outlive its wait."""

import dataclasses
import json
import time
import uuid

import pytest
from django.conf import settings
from django.test import Client

from billing.models import ApiKey, UsageEntry
from inference import lifecycle, streamlog
from inference.gateway import admission
from inference.models import PendingRequest
from inference.protocol.entries import Delta, End, Open
from inference.protocol.payloads import Admitted, Beat, GenerateTask, RequestMeta, State, Status
from inference.signals import request_finished
from tests import sse

MODEL = "a-model"


@pytest.fixture
def queued(redis_client):
    request_id = f"chatcmpl-life-{uuid.uuid4().hex}"
    streamlog.admit(redis_client, request_id, meta(), Open(1, 0))
    return request_id


def meta(deadline_in=600, **fields):
    return RequestMeta("key:1", MODEL, 0, 3, time.time(), time.time() + deadline_in, **fields)


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
    streamlog.admit(redis_client, late, meta(deadline_in=-1), Open(1, 0))
    assert claim(redis_client, late) == "expired"
    assert claim(redis_client, f"{queued}-never-admitted") == "lost"


def test_an_ending_is_published_once(redis_client, queued):
    assert lifecycle.publish_end(redis_client, queued, End(["stop"])) == 1
    assert lifecycle.publish_end(redis_client, queued, End(["error"])) == 0
    assert [e.t for _, e in streamlog.read_all(redis_client, queued)] == ["open", "end"]
    assert claim(redis_client, queued) == "ended"


def test_a_take_over_needs_the_state_it_saw(redis_client, queued):
    assert not lifecycle.take_over(redis_client, queued, Status(State.RUNNING, "w1"))
    assert lifecycle.take_over(redis_client, queued, QUEUED)
    assert not lifecycle.take_over(redis_client, queued, QUEUED)  # someone else was first
    assert lifecycle.take_over(redis_client, f"{queued}-gone", None)


def test_a_prefetching_worker_is_named_only_while_queued(redis_client, queued):
    lifecycle.mark_prefetched(redis_client, queued, "w1")
    assert redis_client.hget(streamlog.key(queued, "meta"), "worker") == "w1"
    beat(redis_client, "w2", time.time() + 60)
    claim(redis_client, queued, "w2")
    lifecycle.mark_prefetched(redis_client, queued, "w3")
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
    again = [lifecycle.apply(redis_client, queued, QUEUED, "claimed", "w1", "token-1", MODEL) for _ in range(2)]
    assert again == [1, 1]
    assert lifecycle.apply(redis_client, queued, QUEUED, "claimed", "w2", "token-2", MODEL) == 0
    assert claim(redis_client, queued, "w1") == "running"  # another delivery, even to the same worker


QUEUED = Status(State.QUEUED)


def seen(state, beats=None, cancelled=False, **fields):
    return lifecycle.Seen(Status.from_redis(state), meta(**fields), cancelled, beats or {})


def beats(*workers, until):
    return {f"{worker}:{MODEL}": Beat(MODEL, until) for worker in workers}


def test_one_verdict_says_when_a_request_is_over():
    now, V = time.time(), lifecycle.Verdict
    live, dead = beats("w1", until=now + 10), beats("w1", until=now - 1)
    cases = [
        (seen(None), None, V.LOST),
        (seen("ended"), None, V.ENDED),
        (seen("ending", ending_at=now - 1), None, V.ENDING),
        (lifecycle.Seen(Status(State.ENDING)), None, V.ORPHANED),  # its metadata expired with its ender
        (seen("ending", ending_at=now - lifecycle.ENDER_GRACE - 1), None, V.ORPHANED),  # its ender stopped
        (seen("running w1", beats=live, cancelled=True), None, None),  # its worker stops it
        (seen("running w1", beats=dead), None, V.ORPHANED),
        (seen("queued", beats=live, cancelled=True), None, V.CANCELLED),
        (seen("queued", beats=live, deadline_in=-1), None, V.EXPIRED),
        (seen("queued", beats=live, worker="w2"), None, V.ORPHANED),  # prefetched by a worker that died
        (seen("queued", beats=live, worker="w1"), None, None),
        (seen("queued", beats=dead), None, V.UNSERVED),
        (seen("queued", beats=live), None, None),
        # asked by a worker taking it, or holding it without having started it (a relay's wait)
        (seen("queued", worker="w2"), "w3", None),  # delivered again after its prefetcher died
        (seen("queued", deadline_in=-1), "w3", V.EXPIRED),
        (seen("running w3", deadline_in=-1), "w3", V.EXPIRED),  # the deadline admission stored
        (seen("running w3", cancelled=True), "w3", V.CANCELLED),
        (seen("running w1", beats=live), "w3", None),
    ]
    for case, by, expected in cases:
        assert lifecycle.verdict(case, MODEL, now, by=by) == expected, (case, by)


def test_the_sweeper_leaves_a_fresh_ending_to_its_ender(redis_client, queued):
    assert lifecycle.take_over(redis_client, queued, QUEUED)
    seen = lifecycle.read(redis_client, queued)
    assert seen.status == Status(State.ENDING) and lifecycle.verdict(seen, MODEL, time.time()) == lifecycle.Verdict.ENDING
    assert lifecycle.verdict(seen, MODEL, time.time() + lifecycle.ENDER_GRACE + 1) == lifecycle.Verdict.ORPHANED


def test_a_requests_status_is_the_worst_of_its_choices():
    assert lifecycle.worst(["stop", "length"]) == "length"
    assert lifecycle.worst(["stop", "error", "cancelled"]) == "error"


def admitted_unclaimed(model=sse.MODEL):
    """A request admitted as the API admits one (its budget held, its keys in Redis, in its
    model's queue) that no worker has taken yet; (its id, the key's secret)."""
    key, raw = ApiKey.issue("lifecycle")
    owner = admission.Owner.of_key(key)
    admitted = Admitted(f"chatcmpl-life-{uuid.uuid4().hex}", model, int(time.time()), 7, 1, time.time(), key.pk)
    task = GenerateTask(admitted.request_id, model, [1] * 7, {"max_tokens": 20}, admitted.received_at, 7, api_key_id=key.pk)
    admission.hold_budget(owner, admitted, task)
    client = streamlog.sync_client()
    streamlog.join_queue(client, model, admitted.request_id)
    streamlog.admit(client, admitted.request_id, admission.meta_of(admitted, owner), Open(1, 0))
    return admitted.request_id, raw


@pytest.mark.django_db(transaction=True)
def test_stopping_a_request_no_worker_took_ends_it_at_once(redis_client):
    request_id, raw = admitted_unclaimed()
    answer = Client().post(f"/v1/chat/completions/{request_id}/cancel", {}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    end = streamlog.end_of(redis_client, request_id)
    assert end is not None and end.finish_reasons == ["cancelled"]  # its reader ends now, not when a worker reaches it
    row = UsageEntry.objects.get(request_id=request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens, row.error) == ("cancelled", 0, 0, "Stopped by its user.")
    assert not PendingRequest.objects.filter(request_id=request_id).exists()
    assert redis_client.zscore(streamlog.queue_key(sse.MODEL), request_id) is None
    again = Client().post(f"/v1/chat/completions/{request_id}/cancel", {}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert again.json()["status"] == "finished"


@pytest.mark.django_db(transaction=True)
def test_request_finished_is_sent_once_and_only_after_the_ledger_row(redis_client, queued):
    heard = []

    def receiver(sender, request_id, **kwargs):
        heard.append(request_id)

    request_finished.connect(receiver, weak=False)
    try:
        orphan_key = Admitted(queued, MODEL, int(time.time()), 3, 1, time.time(), api_key_id=10**9)  # a key that is gone: its ledger row fails
        lifecycle.end(redis_client, orphan_key, lifecycle.Outcome("stop", 3, 2))
        assert streamlog.end_of(redis_client, queued) is not None and not UsageEntry.objects.filter(request_id=queued).exists()
        assert heard == []  # no row yet: the chat page must not settle a reply the ledger lacks
        admitted = dataclasses.replace(orphan_key, api_key_id=None)
        lifecycle.end_as_logged(redis_client, admitted)
        assert heard == [queued] and UsageEntry.objects.get(request_id=queued).completion_tokens == 2
        lifecycle.end(redis_client, admitted, lifecycle.Outcome("stop", 3, 2))  # a second ender
        assert heard == [queued]
    finally:
        request_finished.disconnect(receiver)
