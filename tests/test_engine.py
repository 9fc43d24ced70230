"""The engine driven step by step: a scripted token source, then the real model."""

import torch

from inference.engine import Engine, Request, RequestStatus, SamplingParams
from inference.engine.runner import HFRunner
from tests.scripted import ScriptedRunner

GREEDY = dict(temperature=0)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def make_engine(tokenizer, scripts, max_running=8):
    runner = ScriptedRunner(scripts, len(tokenizer))
    return Engine(runner, tokenizer, stop_ids={2}, context_length=64, max_running=max_running), runner


def run(engine, max_steps=100):
    outputs = []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        outputs.extend(engine.step())
    return outputs


def text_of(outputs, request_id):
    return "".join(o.text for o in outputs if o.request_id == request_id)


def test_it_streams_until_the_stop_token(tokenizer):
    engine, _ = make_engine(tokenizer, {(5,): ids(tokenizer, "Hello there") + [2]})
    request = Request("a", [5], SamplingParams(max_tokens=10, **GREEDY))
    engine.add(request)
    outputs = run(engine)
    assert text_of(outputs, "a") == "Hello there"
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert request.status is RequestStatus.FINISHED
    assert outputs[-1].completion_tokens == len(ids(tokenizer, "Hello there")) + 1


def test_it_stops_at_max_tokens(tokenizer):
    script = ids(tokenizer, " one two three four five six")
    engine, _ = make_engine(tokenizer, {(5,): script})
    engine.add(Request("a", [5], SamplingParams(max_tokens=3, **GREEDY)))
    outputs = run(engine)
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].completion_tokens == 3
    assert text_of(outputs, "a") == tokenizer.decode(script[:3])


def test_requests_share_steps_and_join_while_others_run(tokenizer):
    scripts = {(5,): ids(tokenizer, " alpha beta gamma delta") + [2], (6,): ids(tokenizer, " one two") + [2]}
    engine, runner = make_engine(tokenizer, scripts)
    engine.add(Request("a", [5], SamplingParams(max_tokens=20, **GREEDY)))
    first = engine.step()
    engine.add(Request("b", [6], SamplingParams(max_tokens=20, **GREEDY)))
    second = engine.step()
    assert {o.request_id for o in first} == {"a"}
    assert {o.request_id for o in second} == {"a", "b"}  # b joined the running batch at once
    outputs = first + second + run(engine)
    assert text_of(outputs, "a") == " alpha beta gamma delta"
    assert text_of(outputs, "b") == " one two"
    assert runner.prefills == 2


def test_a_cancel_takes_effect_at_the_next_step_and_frees_the_slot(tokenizer):
    engine, runner = make_engine(tokenizer, {(5,): ids(tokenizer, " x" * 30)}, max_running=1)
    engine.add(Request("a", [5], SamplingParams(max_tokens=30, **GREEDY)))
    engine.add(Request("b", [5], SamplingParams(max_tokens=2, **GREEDY)))
    engine.step()
    engine.step()
    engine.cancel("a")
    outputs = engine.step()
    [cancelled] = [o for o in outputs if o.request_id == "a"]
    assert cancelled.finished and cancelled.finish_reason == "cancelled"
    assert cancelled.completion_tokens == 2  # nothing was generated after the cancel
    engine.step()
    assert [r.request_id for r in engine.running] == ["b"]  # b took the freed slot


def test_a_request_cancelled_while_waiting_never_runs_the_model(tokenizer):
    engine, runner = make_engine(tokenizer, {(5,): ids(tokenizer, " x" * 5)})
    engine.add(Request("a", [5], SamplingParams(max_tokens=5, **GREEDY)))
    engine.cancel("a")
    outputs = engine.step()
    assert outputs[0].finish_reason == "cancelled"
    assert outputs[0].completion_tokens == 0
    assert runner.prefills == 0


def test_a_failing_request_ends_alone(tokenizer):
    engine, runner = make_engine(tokenizer, {(5,): ids(tokenizer, " fine and well") + [2], (6,): []})
    engine.add(Request("good", [5], SamplingParams(max_tokens=10, **GREEDY)))
    engine.add(Request("bad", [6], SamplingParams(max_tokens=10, **GREEDY)))  # its script is empty
    outputs = run(engine)
    [bad] = [o for o in outputs if o.request_id == "bad"]
    assert bad.finish_reason == "error" and "generation failed" in bad.error
    assert text_of(outputs, "good") == " fine and well"
    assert outputs[-1].request_id == "good" and outputs[-1].finish_reason == "stop"


def test_a_stop_string_ends_the_request(tokenizer):
    engine, _ = make_engine(tokenizer, {(5,): ids(tokenizer, "Sure. Answer: yes.\n\nUser: more") + [2]})
    engine.add(Request("a", [5], SamplingParams(max_tokens=40, stop=["\n\nUser:"], **GREEDY)))
    outputs = run(engine)
    assert text_of(outputs, "a") == "Sure. Answer: yes."
    assert outputs[-1].finish_reason == "stop"


def test_the_same_seed_gives_the_same_tokens_whatever_shares_the_step(model):
    runner = HFRunner(model.model, model.device)
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True)

    def sampled(seed, neighbours=()):
        engine = Engine(runner, model.tokenizer, model.stop_ids, model.context_length)
        for n, other in enumerate(neighbours):
            engine.add(Request(f"n{n}", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=other)))
        request = Request("x", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=seed))
        engine.add(request)
        run(engine)
        return request.output_ids

    alone = sampled(1234)
    assert alone == sampled(1234, neighbours=(7, None))
    assert alone != sampled(4321)  # the seed, not the prompt, decided the tokens


def test_greedy_decoding_matches_transformers_generate(model):
    """The per-sequence KV cache must give exactly what a full recompute gives."""
    prompt = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    engine = Engine(HFRunner(model.model, model.device), model.tokenizer, model.stop_ids, model.context_length)
    request = Request("a", prompt, SamplingParams(max_tokens=24, temperature=0))
    engine.add(request)
    run(engine)
    expected = model.model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=24, do_sample=False, eos_token_id=sorted(model.stop_ids), pad_token_id=2,
    )[0, len(prompt):].tolist()  # fmt: skip
    assert request.output_ids == expected
