"""The same task delivered twice while it runs, or again after it ended: one generation, one
ledger row, and nothing generated for a client that is gone."""

import threading
import time

import pytest

from inference import lifecycle, streamlog
from inference.models import PendingRequest
from inference.protocol.entries import Delta
from inference.protocol.payloads import GENERATE, State
from tests.faults.conftest import rows_for
from tests.faults.streams import body, record
from tests.faults.test_worker_killed import ESSAY, wait_for_requests, wait_until_running
from tokstream_site.celery import app

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_task_delivered_again_is_generated_once(live_service, api_key, redis_client):
    payload = body(ESSAY, max_tokens=120)
    streams = []
    runner = threading.Thread(target=lambda: streams.append(record(live_service.url, api_key, payload)))
    runner.start()
    [request_id] = wait_for_requests(api_key, 1)
    wait_until_running(redis_client, [request_id], 1)
    task = PendingRequest.objects.get(request_id=request_id).task
    for _ in range(2):  # as a broker that redelivers while the first still runs
        app.send_task(GENERATE, kwargs=task, queue="inference")
    runner.join(timeout=120)

    [stream] = streams
    assert stream.done and stream.error is None
    # One generation, not two interleaved: its deltas count tokens up by one step at a time.
    deltas = [entry for _, entry in streamlog.read_all(redis_client, request_id) if isinstance(entry, Delta)]
    counts = [delta.completion_tokens for delta in deltas]
    assert counts == sorted(set(counts)) and counts[-1] == 120
    assert "".join(delta.text for delta in deltas) == stream.text
    [row] = rows_for([request_id], seconds=10)[request_id]
    assert row.status == "length" and row.completion_tokens == 120

    length = redis_client.xlen(streamlog.key(request_id, "log"))
    app.send_task(GENERATE, kwargs=task, queue="inference")  # after its end
    time.sleep(3)
    assert redis_client.xlen(streamlog.key(request_id, "log")) == length
    assert redis_client.get(lifecycle.state_key(request_id)) == State.ENDED
    assert len(rows_for([request_id], seconds=1)[request_id]) == 1
