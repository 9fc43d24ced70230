"""A worker asked to stop while it loads its model stops then, without taking a task: Celery's
handlers only set a flag, and the load held the main thread that reads it."""

import os
import signal

import pytest

from tests.service import LiveService
from tests.waiting import eventually
from tokstream_site import processes


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGQUIT])
def test_a_worker_stopped_while_it_loads_its_model_exits(django_db_setup, redis_client, how):
    from django.db import connection

    redis_url = os.environ["TEST_REDIS_URL"].rsplit("/", 1)[0] + "/8"  # a queue of its own
    service = LiveService(connection.settings_dict, TEST_REDIS_URL=redis_url)
    service.logs.mkdir(parents=True, exist_ok=True)
    service.spawn("worker", processes.worker_command(2, hostname=f"test-{service.port}-loading@%h"))
    [worker] = service.children
    log = service.logs / "worker.log"
    try:
        # Mingle is the last step before Celery calls worker_ready, which loads the model.
        eventually(lambda: "mingle: all alone" in log.read_text(), seconds=120, message="the worker never got to loading")
        worker.send_signal(how)
        assert worker.wait(timeout=20) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    text = log.read_text()
    assert "asked to stop while loading the models" in text and " loaded on " not in text
