"""Endings the other fault tests do not reach: a request past its queue deadline, and a
generation that fails in the model."""

import threading
import time

import httpx
import pytest
from django.conf import settings

from billing.models import UsageEntry
from inference import streamlog
from inference.gateway.admission import Owner, meta_of
from inference.models import PendingRequest
from inference.protocol.chunks import ChunkWriter
from inference.protocol.entries import Delta, End, Open
from inference.protocol.payloads import Admitted
from inference.worker import engines as worker
from inference.worker import tasks
from tests.conftest import separate_service
from tests.faults.conftest import holds_back, rows_for
from tests.faults.streams import body, record
from tests.faults.test_worker_killed import ESSAY, wait_for_requests, wait_until_running
from tests.sse import MODEL, auth

pytestmark = pytest.mark.django_db(transaction=True)
DEADLINE = 20  # seconds a request may wait for a worker, in this test


@pytest.fixture
def one_slot(django_db_setup, django_db_blocker, redis_client):
    # One decode slot and a 20 s deadline, so that a second request waits past its deadline
    # within the test (shipped: 32 slots, 600 s).
    options = dict(TOKSTREAM_MAX_RUNNING="1", TOKSTREAM_QUEUE_TIMEOUT=str(DEADLINE))
    with separate_service(django_db_blocker, 4, **options) as service:
        yield service


def test_a_request_past_its_queue_deadline_fails_unrun(one_slot, budgeted):
    _, key, budget = budgeted
    first = []
    # The end-of-turn tokens barred, so the essay holds the one slot for all its 4,000 tokens,
    # well past the 20 s deadline, wherever a greedy reply would have stopped by itself; no
    # drafts, which would verify a barred essay's repetitions several tokens a step. It is
    # cancelled once the late request has failed.
    hold = body(ESSAY, max_tokens=4000, logit_bias={"0": -100, "2": -100}, tokstream={"speculative": False})
    runner = threading.Thread(target=lambda: first.append(record(one_slot.url, key, hold)))
    runner.start()
    client = streamlog._sync_client(one_slot.env["TEST_REDIS_URL"])
    held = wait_until_running(client, wait_for_requests(key, 1), 1)  # the one slot is taken: the next request waits
    late = record(one_slot.url, key, body("Name a fruit.", max_tokens=8))
    assert late.done and late.error["code"] == "queue_timeout" and late.text == ""
    # Told by its reader's next idle check after the deadline, though the worker had prefetched
    # it (its one thread busy with the essay): not when that thread came free.
    assert late.ended_at - late.started < DEADLINE + settings.TOKSTREAM_KEEPALIVE_SECONDS + 5
    assert late.usage["completion_tokens"] == 0
    [row] = rows_for([late.request_id], seconds=10)[late.request_id]
    assert row.status == "failed" and row.prompt_tokens == 0 and row.completion_tokens == 0 and "TOKSTREAM_QUEUE_TIMEOUT" in row.error
    httpx.post(f"{one_slot.url}/v1/chat/completions/{held[0]}/cancel", headers=auth(key), timeout=30)  # the essay has done its part
    runner.join()
    rows_for([first[0].request_id], seconds=30)
    time.sleep(3)  # the worker has taken the late task by now: it found it ended
    assert [e.t for _, e in streamlog.read_all(client, late.request_id)] == ["open", "end"]
    assert UsageEntry.objects.filter(request_id=late.request_id).count() == 1
    assert holds_back(budget)


@pytest.fixture
def engine_here(settings, monkeypatch, redis_client):
    """The model's engine in this process, on keys no worker of the service reads."""
    settings.TOKSTREAM_DEVICE = "cpu"
    settings.TOKSTREAM_REDIS_PREFIX += ":endings"
    monkeypatch.setattr(worker, "_loops", {})
    loop = worker.engine_loop(MODEL)
    yield loop
    loop.stop()
    loop.join(timeout=30)


def test_a_generation_that_fails_ends_with_an_error_and_a_failed_row(engine_here, tokenizer, api_key, monkeypatch):
    forward, calls = engine_here.engine.runner.forward, []

    def failing_forward(chunks):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("the accelerator fell over")
        return forward(chunks)

    monkeypatch.setattr(engine_here.engine.runner, "forward", failing_forward)
    task = admitted_here(tokenizer, "Write a long essay about tea.")
    tasks.generate(**task)

    entries = [entry for _, entry in streamlog.read_all(streamlog.sync_client(), task["request_id"])]
    end = entries[-1]
    assert isinstance(end, End) and "the accelerator fell over" in end.error
    produced = [e for e in entries if isinstance(e, Delta)]
    admitted = Admitted(task["request_id"], MODEL, 0, len(task["prompt_ids"]))
    error, usage = ChunkWriter(admitted, include_usage=True).chunks(end)
    assert error["error"]["type"] == "server_error" and usage["usage"] == end.usage.to_dict()
    row = UsageEntry.objects.get(request_id=task["request_id"])
    assert row.status == "failed" and "the accelerator fell over" in row.error
    assert (
        row.prompt_tokens == len(task["prompt_ids"])
        and row.completion_tokens == (produced[-1].completion_tokens if produced else 0) == end.usage.completion_tokens
    )
    assert not PendingRequest.objects.filter(request_id=task["request_id"]).exists()


def admitted_here(tokenizer, content):
    """A request as admission leaves it: its pending row, metadata, state and opening."""
    from billing.models import ApiKey

    key = ApiKey.objects.latest("pk")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    request_id = f"chatcmpl-failing-{time.time_ns()}"
    task = {
        "request_id": request_id,
        "model": MODEL,
        "prompt_ids": prompt,
        "params": {"max_tokens": 40, "temperature": 0},
        "received_at": time.time(),
        "api_key_id": key.pk,
        "prompt_tokens": len(prompt),
    }
    PendingRequest.objects.create(
        request_id=request_id,
        keyspace=streamlog.keyspace(),
        model=MODEL,
        api_key_id=key.pk,
        prompt_tokens=len(prompt),
        received_at=task["received_at"],
        task=task,
    )
    meta = meta_of(Admitted(request_id, MODEL, int(time.time()), len(prompt), 1, task["received_at"], key.pk), Owner(api_key_id=key.pk))
    streamlog.admit(streamlog.sync_client(), request_id, meta, Open(1, 0))
    return task
