"""A worker killed (SIGKILL) with requests running, prefetched and still in the broker: every
client gets an error and [DONE] in bounded time, every request one `failed` row, and nothing
it held stays held."""

import os
import signal
import threading
import time

import openai
import pytest
from django.conf import settings

from inference import lifecycle, streamlog
from inference.models import PendingRequest
from inference.protocol.payloads import GENERATE, Status
from tests.conftest import separate_service
from tests.faults.conftest import holds_back, queue_empty, rows_for
from tests.faults.streams import body, record, record_many
from tests.sse import MODEL
from tests.waiting import eventually
from tokstream_site import processes

pytestmark = pytest.mark.django_db(transaction=True)
ESSAY = "Write a long essay about the history of tea."
# A claimed or prefetched request: its reader's idle check finds the worker's beat expired;
# one still in the broker: two idle checks in a row find no worker for its model.
BOUND = settings.TOKSTREAM_WORKER_TTL + 3 * settings.TOKSTREAM_KEEPALIVE_SECONDS


@pytest.fixture
def service(django_db_setup, django_db_blocker, redis_client):
    # 8 slots: the 24 requests are then running, prefetched and still in the broker, all three.
    with separate_service(django_db_blocker, 3, TOKSTREAM_MAX_RUNNING="8") as service:
        yield service


def states(client, request_ids):
    return {r: Status.from_redis(client.get(lifecycle.state_key(r))) for r in request_ids}


def test_every_client_of_a_killed_worker_gets_its_end(service, budgeted):
    _, key, budget = budgeted
    client = streamlog._sync_client(service.env["TEST_REDIS_URL"])
    streams = []
    runner = threading.Thread(target=lambda: streams.extend(record_many(service.url, key, [body(ESSAY, max_tokens=600)] * 24)))
    runner.start()
    ids = wait_for_requests(key, 24)
    running = wait_until_running(client, ids, 8)
    tasks = {r.request_id: r.task for r in PendingRequest.objects.filter(request_id__in=ids)}
    reserved = [r for r in ids if r not in running and client.hget(streamlog.key(r, "meta"), "worker")]
    worker = service.children[0]
    os.kill(worker.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    runner.join(timeout=BOUND + 60)

    assert len(streams) == 24 and all(s.done for s in streams), [s.failure for s in streams if not s.done]
    assert all(s.error["code"] == "worker_unavailable" for s in streams)
    assert max(s.ended_at for s in streams) - killed_at < BOUND + 5
    assert reserved, "the test needs requests the worker had prefetched"
    rows = rows_for(ids, seconds=10)
    by_id = {s.request_id: s for s in streams}
    for request_id, found in rows.items():
        assert len(found) == 1 and found[0].status == "failed"
        assert found[0].completion_tokens == by_id[request_id].completion_seen  # what the client saw
        assert (found[0].prompt_tokens > 0) == (request_id in running)  # the prompt, once it was read
    assert holds_back(budget) and queue_empty(client)
    sdk = openai.OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as unavailable:  # no worker now: 503 at once
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert unavailable.value.status_code == 503 and unavailable.value.body["code"] == "model_unavailable"

    service.children.remove(worker)
    service.spawn("worker-restarted", processes.worker_command(service.concurrency, hostname=f"again-{service.port}@%h"))
    service.wait_healthy(timeout=120)
    fresh = record(service.url, key, body("Name a fruit.", max_tokens=8))
    assert fresh.done and fresh.error is None and fresh.text
    # Redelivered after the death (as the broker does after its visibility time-out): nothing
    # is generated for clients that are gone, and no second row.
    again = [running[0], reserved[0]]
    from tokstream_site.celery import app

    app.conf.broker_url = service.env["TEST_REDIS_URL"]
    log_lengths = {r: client.xlen(streamlog.key(r, "log")) for r in again}
    for request_id in again:
        app.send_task(GENERATE, kwargs=tasks[request_id], queue="inference")
    time.sleep(5)
    assert {r: client.xlen(streamlog.key(r, "log")) for r in again} == log_lengths
    assert all(len(found) == 1 for found in rows_for(ids, seconds=1).values())


def wait_for_requests(key, count, seconds=60):
    """The ids of `count` requests admitted for this raw key."""
    from billing.models import ApiKey

    key_id = ApiKey.authenticate(key).pk

    def admitted():
        ids = list(PendingRequest.objects.filter(api_key_id=key_id).values_list("request_id", flat=True))
        return ids if len(ids) >= count else None

    return eventually(admitted, seconds, message=f"fewer than {count} requests were admitted")


def wait_until_running(client, ids, count, seconds=120):
    """Until `count` requests have produced text: their ids."""

    def producing():
        running = [r for r, state in states(client, ids).items() if state and state.holder()]
        found = [r for r in running if client.xlen(streamlog.key(r, "log")) > 2]
        return found if len(found) >= count else None

    return eventually(producing, seconds, message=f"fewer than {count} requests started")
