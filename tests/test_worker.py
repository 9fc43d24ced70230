"""The worker's engines: one per device, each on its own thread, fed by Celery tasks."""

import pytest

from inference.worker import engines as worker
from inference.worker.engine import SamplingParams
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
