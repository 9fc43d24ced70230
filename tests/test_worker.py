"""The worker's engines: one per device, each on its own thread, fed by Celery tasks."""

import threading

import pytest

from inference import streamlog
from inference.protocol.entries import Delta
from inference.protocol.payloads import State, Status
from inference.worker import engines as worker
from inference.worker import local
from inference.worker.engine import SamplingParams
from inference.worker.local import Choice
from tests.reference import reference
from tests.sse import MODEL


@pytest.fixture
def two_cpu_engines(settings, monkeypatch, redis_client):
    settings.TOKSTREAM_DEVICE = "cpu,cpu"  # as two GPUs would be: one engine each
    settings.TOKSTREAM_WEIGHTS = "float32"  # their replies are compared with `generate`
    settings.TOKSTREAM_REDIS_PREFIX += ":two-engines"  # their heartbeats stay out of the service's
    monkeypatch.setattr(worker, "_loops", {})
    yield
    for loop in worker._loops.get(MODEL, []):
        loop.stop()
        loop.join(timeout=30)


def test_each_device_gets_an_engine_and_requests_go_to_the_least_loaded(two_cpu_engines, model):
    prompts = [
        model.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in ("Hi", "Name a tree.", "Name a bird.")
    ]
    submitted = []
    for n, prompt in enumerate(prompts):
        loop = worker.engine_loop(MODEL)
        submitted.append((loop, prompt, loop.submit(f"r{n}", prompt, SamplingParams(max_tokens=8, temperature=0))))
    loops = worker._loops[MODEL]
    assert len(loops) == 2 and loops[0].model.model is not loops[1].model.model
    assert submitted[0][0] is not submitted[1][0]  # the second went to the idle engine
    for _, prompt, outbox in submitted:
        while not (output := outbox.get(timeout=60)).finished:
            pass
        assert output.totals.token_ids == reference(model, prompt, 8)
    assert all(loop.load() == 0 for loop in loops)


def test_a_model_that_cannot_load_fails_the_engine_start_instead_of_hanging_it(settings, monkeypatch):
    # The engine thread loads its own model; what goes wrong there reaches the thread that
    # started it (the worker then exits: process.load_models), and no half-made engine is kept.
    settings.TOKSTREAM_DTYPE = "no_such_dtype"
    monkeypatch.setattr(worker, "_loops", {})
    with pytest.raises(AttributeError, match="no_such_dtype"):
        worker.engine_loop(MODEL)
    assert worker._loops == {}


@pytest.fixture
def echo_loop(settings, monkeypatch, redis_client):
    settings.TOKSTREAM_REDIS_PREFIX += ":echo-loop"  # its heartbeats stay out of the service's
    monkeypatch.setattr(worker, "_loops", {})
    loop = worker.engine_loop("echo")
    yield loop
    loop.stop()
    loop.join(timeout=30)


def test_a_log_that_refuses_its_entries_fails_its_own_request_and_no_other(echo_loop, redis_client, tokenizer):
    # The engine loop writes a step's entries of every request in one round trip: one log that
    # Redis refuses (a key of another type) must not take the others down with it.
    words = "one two three four five six seven eight"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": words}], add_generation_prompt=True)
    for request_id in ("healthy", "broken"):  # claimed by this worker, as a task would have
        redis_client.set(streamlog.key(request_id, "state"), Status(State.RUNNING, echo_loop.worker_id).to_redis())
    redis_client.set(streamlog.key("broken", "log"), "not a stream")
    requests = {request_id: ([Choice()], []) for request_id in ("healthy", "broken")}
    threads = [
        threading.Thread(target=run, args=(echo_loop, request_id, prompt, seen, gaps))
        for request_id, (seen, gaps) in requests.items()
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    healthy, broken = requests["healthy"][0][0], requests["broken"][0][0]
    assert healthy.finish_reason == "stop" and healthy.error is None
    assert "".join(e.text for _, e in streamlog.read_all(redis_client, "healthy") if isinstance(e, Delta)) == words
    assert len(requests["healthy"][1]) == len(words.split()) - 1  # a gap between each two words' outputs
    assert broken.finish_reason == "error" and broken.error.startswith("the stream log failed: WRONGTYPE")
    assert len(broken.totals.token_ids) < len(healthy.totals.token_ids)  # stopped at its first write, not at its end


def run(loop, request_id, prompt, seen, gaps):
    try:
        local.stream_outputs(loop, request_id, prompt, SamplingParams(max_tokens=50), seen, gaps=gaps)
    except RuntimeError:
        pass  # the broken log's request raises once it has ended
