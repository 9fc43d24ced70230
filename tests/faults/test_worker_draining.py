"""The only worker asked to stop (SIGTERM) finishes the reply it runs and takes nothing new:
while it drains, a new request is refused at once with a 503 and Retry-After instead of
waiting for a worker that will never take it, and /healthz says why."""

import signal
import threading
import time

import httpx
import pytest

from tests.conftest import separate_service
from tests.faults.conftest import rows_for
from tests.faults.streams import body, record
from tests.sse import auth
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
ESSAY = "Write a long essay about the history of tea."


@pytest.fixture
def service(django_db_setup, django_db_blocker, redis_client):
    with separate_service(django_db_blocker, 9) as service:
        yield service


def health(service):
    response = httpx.get(f"{service.url}/healthz", timeout=10)
    return response.status_code, response.json()["checks"]["workers"]


def test_requests_are_refused_at_once_while_the_only_worker_drains(service, budgeted):
    _, key, _ = budgeted
    replying, streams = threading.Event(), []
    runner = threading.Thread(target=lambda: streams.append(record(service.url, key, body(ESSAY, max_tokens=160), hold=lambda _: replying.set())))
    runner.start()
    assert replying.wait(120), "the reply never began"
    worker = service.children[0]
    worker.send_signal(signal.SIGTERM)
    eventually(lambda: health(service)[0] == 503, seconds=10, message=lambda: f"/healthz still says {health(service)}")
    assert "draining" in health(service)[1]["error"]

    for _ in range(3):
        asked = time.monotonic()
        response = httpx.post(f"{service.url}/v1/chat/completions", json=body("Name a fruit.", max_tokens=8), headers=auth(key), timeout=30)
        assert time.monotonic() - asked < 5  # answered, not queued behind the drain
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "model_unavailable" and "shutting down" in response.json()["error"]["message"]
        assert int(response.headers["Retry-After"]) > 0
    assert runner.is_alive(), "the reply ended before the refusals were tried: the test needs a longer one"

    runner.join(timeout=120)
    [stream] = streams
    assert stream.done and stream.error is None and stream.usage["completion_tokens"] == 160
    assert rows_for([stream.request_id], seconds=10)[stream.request_id][0].status == "length"
    assert worker.wait(timeout=60) == 0
