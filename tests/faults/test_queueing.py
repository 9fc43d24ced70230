"""More streams than a worker decodes at once: the queued ones wait longer than the keep-alive
interval, and every one of them still ends, whole."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings

from inference import streamlog
from tests.conftest import separate_service
from tests.faults.conftest import holds_back, queue_empty, rows_for
from tests.faults.streams import body, record_many, whole
from tests.faults.test_worker_killed import wait_for_requests, wait_until_running

pytestmark = pytest.mark.django_db(transaction=True)
QUESTIONS = ["Name a fruit.", "Name a colour.", "Name a planet.", "Name a tree.", "Say hello.", "Count to five."]


RUNNING = 8  # decode slots of the worker under test: the 32 shipped behave alike, four times slower
HELD_TOKENS = 320  # the replies that hold every slot: 8 of them take 25-50 s on a 2-core CPU in float32
QUEUED_TOKENS = 48


@pytest.fixture
def float32_service(django_db_setup, django_db_blocker, redis_client):
    # float32: the queued replies are compared with one alone token for token. A reduced format
    # rounds activations to bfloat16, so a prompt prefilled in other pieces, or partly from the
    # prefix cache, can break a near tie the other way a hundred tokens on (see README).
    with separate_service(django_db_blocker, 5, TOKSTREAM_WEIGHTS="float32", TOKSTREAM_MAX_RUNNING=str(RUNNING)) as service:
        yield service


def test_it_ends_twice_as_many_concurrent_streams_as_a_worker_decodes_whole(float32_service, budgeted):
    live_service = float32_service
    redis_client = streamlog._sync_client(live_service.env["TEST_REDIS_URL"])
    _, key, budget = budgeted
    # Each runs to its max_tokens (the end-of-turn tokens banned): the first half holds every
    # slot for longer than the keep-alive interval, and the second half, sent at once while it
    # does, queues for all that time.
    no_end = {str(token): -100 for token in (0, 1, 2)}
    # No drafts either: one alone drafts, a queued one in a full batch does not, and a draft is
    # verified through prefill attention, whose rounding differs a little from a decode step's.
    options = dict(logit_bias=no_end, tokstream={"speculative": False})
    holding = [body(QUESTIONS[n % len(QUESTIONS)], max_tokens=HELD_TOKENS, **options) for n in range(RUNNING)]
    queued = [body(QUESTIONS[n % len(QUESTIONS)], max_tokens=QUEUED_TOKENS, **options) for n in range(RUNNING)]
    held = []
    runner = threading.Thread(target=lambda: held.extend(record_many(live_service.url, key, holding)))
    runner.start()
    wait_until_running(redis_client, wait_for_requests(key, RUNNING), RUNNING)
    waiting = record_many(live_service.url, key, queued)
    runner.join()
    streams = held + waiting

    assert [s.failure for s in streams if not s.done] == []
    assert [s.error for s in streams if s.error] == []
    assert all(s.status == 200 and s.done for s in streams)
    waited = [s for s in waiting if s.first_text_at - s.opened_at > settings.TOKSTREAM_KEEPALIVE_SECONDS + 1]
    assert len(waited) == RUNNING, "the test needs streams that wait longer than the keep-alive interval"
    assert [s.keepalives_before_text for s in waited if s.keepalives_before_text < 1] == []
    assert max(s.queue_position for s in waiting) == RUNNING - 1  # queued ones were told where they wait
    # A sample: what the queued streams got is what the same requests get unstreamed (asked at
    # once, so they batch).
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        unstreamed = list(pool.map(lambda payload: whole(live_service.url, key, payload), queued[: len(QUESTIONS)]))
    assert [s.text for s in waiting[: len(QUESTIONS)]] == unstreamed
    rows = rows_for([s.request_id for s in streams], seconds=30)
    assert all(len(found) == 1 for found in rows.values())
    assert [
        (found[0].completion_tokens, s.usage) for s, found in zip(streams, rows.values()) if found[0].completion_tokens != s.usage["completion_tokens"]
    ] == []
    assert holds_back(budget) and queue_empty(redis_client)
