"""Redis restarted mid-stream (it keeps nothing on disk, as `make run` starts it): every open
stream ends with a terminal event, every admitted request ends with exactly one ledger row,
the holds come back, and the service answers again without restarting anything."""

import threading
import time

import pytest
from django.conf import settings

from inference import lifecycle
from inference.models import PendingRequest
from tests.conftest import separate_service
from tests.faults.conftest import holds_back, rows_for
from tests.faults.streams import body, record, record_many
from tests.faults.test_worker_killed import ESSAY, wait_for_requests, wait_until_running
from tests.settings import free_port
from tests.waiting import eventually
from tokstream_site import processes

pytestmark = pytest.mark.django_db(transaction=True)
# A reader's Redis call fails, or its next idle check finds the request unknown.
STREAM_BOUND = settings.TOKSTREAM_KEEPALIVE_SECONDS + 10
# Requests lost with the broker's queue: the sweeper's period, after a pending row's grace.
ROW_BOUND = lifecycle.SWEEP_AFTER + 2 * lifecycle.SWEEP_SECONDS


@pytest.fixture
def own_redis():
    url = f"redis://127.0.0.1:{free_port()}/0"
    server = [processes.start_redis(url)]
    yield url, server
    server[0].kill()
    server[0].wait()


@pytest.fixture
def service(django_db_setup, django_db_blocker, own_redis):
    with separate_service(django_db_blocker, 0, redis_url=own_redis[0]) as service:
        yield service


def restart(url, server):
    server[0].kill()
    server[0].wait()
    server[0] = processes.start_redis(url)


def test_a_redis_restart_ends_every_stream_and_loses_no_row(service, own_redis, budgeted):
    _, key, budget = budgeted
    from inference import streamlog

    client = streamlog._sync_client(own_redis[0])
    streams = []
    runner = threading.Thread(target=lambda: streams.extend(record_many(service.url, key, [body(ESSAY, max_tokens=600)] * 20)))
    runner.start()
    ids = wait_for_requests(key, 20)
    wait_until_running(client, ids, 8)
    restart(*own_redis)
    restarted_at = time.monotonic()
    runner.join(timeout=STREAM_BOUND + 60)

    assert len(streams) == 20 and all(s.done for s in streams), [s.failure for s in streams if not s.done]
    # As the README's "How a stream ends" says: the error, the usage so far, [DONE].
    assert {s.error["code"] for s in streams} <= {"request_lost", "stream_interrupted"}
    assert all(s.usage["completion_tokens"] >= s.completion_seen for s in streams)
    assert max(s.ended_at for s in streams) - restarted_at < STREAM_BOUND
    rows = rows_for(ids, seconds=ROW_BOUND + 10)
    assert {
        request_id: [(row.status, row.error) for row in found] for request_id, found in rows.items() if len(found) != 1 or found[0].status != "failed"
    } == {}
    assert not PendingRequest.objects.filter(request_id__in=ids).exists()
    assert holds_back(budget)
    assert answers_again(service, key)


def answers_again(service, key, seconds=60):
    def answered():
        fresh = record(service.url, key, body("Name a fruit.", max_tokens=8))
        return fresh.done and fresh.error is None and fresh.text

    return eventually(answered, seconds, interval=2, message="the service did not answer again after the restart")
