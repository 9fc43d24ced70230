"""The engine driven step by step: a scripted token source, then the real model."""

import pytest

from inference.worker.engine import (
    Engine,
    Request,
    RequestStatus,
    SamplingParams,
    choices,
)
from tests.reference import reference
from tests.scripted import ScriptedRunner

GREEDY = dict(temperature=0)


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def make_engine(tokenizer, scripts, max_running=8, **options):
    runner = ScriptedRunner(scripts, len(tokenizer))
    return Engine(runner, tokenizer, stop_ids={2}, context_length=64, max_running=max_running, **options), runner


def run(engine, max_steps=1000):
    outputs = []
    for _ in range(max_steps):
        if not engine.has_work():
            break
        outputs.extend(engine.step())
    return outputs


def text_of(outputs, request_id):
    return "".join(o.text for o in outputs if o.request_id == request_id)


# -- scheduling, with a scripted model ---------------------------------------------------


def test_it_streams_until_the_stop_token(tokenizer):
    engine, _ = make_engine(tokenizer, {"a": ids(tokenizer, "Hello there") + [2]})
    request = Request("a", [5], SamplingParams(max_tokens=10, **GREEDY))
    engine.add(request)
    outputs = run(engine)
    assert text_of(outputs, "a") == "Hello there"
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert request.status is RequestStatus.FINISHED
    assert outputs[-1].completion_tokens == len(ids(tokenizer, "Hello there")) + 1


def test_it_stops_at_max_tokens(tokenizer):
    script = ids(tokenizer, " one two three four five six")
    engine, _ = make_engine(tokenizer, {"a": script})
    engine.add(Request("a", [5], SamplingParams(max_tokens=3, **GREEDY)))
    outputs = run(engine)
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].completion_tokens == 3
    assert text_of(outputs, "a") == tokenizer.decode(script[:3])


def test_requests_share_steps_and_join_while_others_run(tokenizer):
    scripts = {"a": ids(tokenizer, " alpha beta gamma delta") + [2], "b": ids(tokenizer, " one two") + [2]}
    engine, _ = make_engine(tokenizer, scripts)
    engine.add(Request("a", [5], SamplingParams(max_tokens=20, **GREEDY)))
    first = engine.step()
    engine.add(Request("b", [6], SamplingParams(max_tokens=20, **GREEDY)))
    second = engine.step()
    assert {o.request_id for o in first} == {"a"}
    assert {o.request_id for o in second} == {"a", "b"}  # b joined the running batch at once
    outputs = first + second + run(engine)
    assert text_of(outputs, "a") == " alpha beta gamma delta"
    assert text_of(outputs, "b") == " one two"


def test_a_cancel_takes_effect_at_the_next_step_and_frees_the_slot_and_cache(tokenizer):
    engine, _ = make_engine(tokenizer, {"a": ids(tokenizer, " x" * 30), "b": ids(tokenizer, " y" * 5)}, max_running=1)
    free_before = engine.pool.available()
    engine.add(Request("a", [5], SamplingParams(max_tokens=30, **GREEDY)))
    engine.add(Request("b", [5], SamplingParams(max_tokens=2, **GREEDY)))
    engine.step()
    engine.step()
    engine.cancel("a")
    outputs = engine.step()
    [cancelled] = [o for o in outputs if o.request_id == "a"]
    assert cancelled.finished and cancelled.finish_reason == "cancelled"
    assert cancelled.completion_tokens == 2  # nothing was generated after the cancel
    assert [r.request_id for r in engine.scheduler.running] == ["b"]  # b took the freed slot
    run(engine)
    assert engine.pool.available() == free_before


def test_a_request_cancelled_while_waiting_never_runs_the_model(tokenizer):
    engine, runner = make_engine(tokenizer, {"a": ids(tokenizer, " x" * 5)})
    engine.add(Request("a", [5], SamplingParams(max_tokens=5, **GREEDY)))
    engine.cancel("a")
    outputs = engine.step()
    assert outputs[0].finish_reason == "cancelled"
    assert outputs[0].completion_tokens == 0
    assert runner.computed == 0


def test_a_failing_request_ends_alone(tokenizer):
    engine, _ = make_engine(tokenizer, {"good": ids(tokenizer, " fine and well") + [2], "bad": [None]})
    engine.add(Request("good", [5], SamplingParams(max_tokens=10, **GREEDY)))
    engine.add(Request("bad", [6], SamplingParams(max_tokens=10, temperature=1.0)))  # NaN logits
    outputs = run(engine)
    [bad] = [o for o in outputs if o.request_id == "bad"]
    assert bad.finish_reason == "error" and "generation failed" in bad.error
    assert text_of(outputs, "good") == " fine and well"
    assert outputs[-1].request_id == "good" and outputs[-1].finish_reason == "stop"


def test_a_stop_string_ends_the_request(tokenizer):
    engine, _ = make_engine(tokenizer, {"a": ids(tokenizer, "Sure. Answer: yes.\n\nUser: more") + [2]})
    engine.add(Request("a", [5], SamplingParams(max_tokens=40, stop=["\n\nUser:"], **GREEDY)))
    outputs = run(engine)
    assert text_of(outputs, "a") == "Sure. Answer: yes."
    assert outputs[-1].finish_reason == "stop"


def test_a_prompt_that_cannot_fit_waits_and_a_request_that_never_can_is_refused(tokenizer):
    engine, _ = make_engine(tokenizer, {"a": ids(tokenizer, " x" * 30), "b": ids(tokenizer, " y" * 3), "huge": []})
    engine.pool.reserve(engine.pool.available() - 3)  # leave room for 3 blocks (48 tokens)
    engine.add(Request("a", [5], SamplingParams(max_tokens=30, **GREEDY)))  # 1 block now, 2 later
    engine.add(Request("b", [6] * 33, SamplingParams(max_tokens=3, **GREEDY)))  # 3 blocks for its prompt: must wait
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a"] and engine.scheduler.waiting[0].request_id == "b"
    outputs = run(engine)
    assert text_of(outputs, "b") == " y" * 3  # ran once a finished and gave its blocks back
    engine.add(Request("huge", [7], SamplingParams(max_tokens=10**6, **GREEDY)))
    [refused] = engine.step()
    assert refused.finish_reason == "error" and "larger than the whole KV cache" in refused.error
    engine.add(Request("empty", [], SamplingParams(max_tokens=3, **GREEDY)))
    [empty] = engine.step()
    assert empty.finish_reason == "error" and not engine.has_work()


def test_requests_take_blocks_as_they_grow_so_more_run_than_their_worst_cases_allow(tokenizer):
    scripts = {name: ids(tokenizer, " x" * 6) + [2] for name in "abcdefgh"}
    engine, _ = make_engine(tokenizer, scripts)
    engine.pool.reserve(engine.pool.available() - 16)  # 16 blocks; each worst case is 60 tokens: 4 blocks
    engine.add(*[Request(name, [5] * 10, SamplingParams(max_tokens=50, **GREEDY)) for name in scripts])
    outputs = engine.step()
    assert len(engine.scheduler.running) == 8  # a block each to start, and one left for each to grow into; at their worst case, 4
    outputs += run(engine)
    assert all(text_of(outputs, name) == " x" * 6 for name in scripts) and not engine.stats["preemptions"]


def test_a_full_cache_preempts_the_newest_request_which_resumes_where_it_was(tokenizer):
    scripts = {"a": ids(tokenizer, " x" * 40), "b": ids(tokenizer, " y" * 40)}
    engine, _ = make_engine(tokenizer, scripts)
    held = engine.pool.available() - 4
    engine.pool.reserve(held)  # 4 blocks: each needs 3 at its end
    engine.add(Request("a", [5], SamplingParams(max_tokens=40, **GREEDY)), Request("b", [6], SamplingParams(max_tokens=40, **GREEDY)))
    outputs = run(engine)
    assert text_of(outputs, "a") == " x" * 40 and text_of(outputs, "b") == " y" * 40
    assert engine.stats["preemptions"] >= 1 and engine.stats["computed_prompt_tokens"] == 2  # each prompt token counts once
    assert [o.finish_reason for o in outputs if o.finished] == ["length", "length"]
    assert engine.pool.reserved == held and all(n == 0 for n in engine.pool.refs)  # only the test's own hold is left


# -- the real model ------------------------------------------------------------------------


def real_engine(model, cache_tokens=16384, weights="float32", **options):
    # float32: the weights transformers runs, so outputs compare with `generate` token for token.
    # The formats `auto` may pick instead are held to a bound on their drift (test_weights.py).
    return Engine.for_model(model, cache_tokens, weights=weights, **options)


def chat(model, text):
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


# Short answers end early: both sides keep the special tokens out, so 32 tokens always compare.
SPECIALS = (0, 1, 2)
NO_SPECIALS = {token: -1e9 for token in SPECIALS}


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=NO_SPECIALS)


def reference_greedy(model, prompt, tokens):
    return reference(model, prompt, tokens, suppress_tokens=list(SPECIALS))


def test_a_preempted_request_gives_the_reply_it_gives_alone(model):
    """A cache too small for three replies at once: some are preempted and computed again, and
    every reply is the one it gives alone (greedy and seeded), its prompt counted once."""
    asks = [
        (chat(model, q), SamplingParams(max_tokens=60, logit_bias=NO_SPECIALS, **sampled))
        for q in QUESTIONS[:3]
        for sampled in (GREEDY, dict(temperature=0.8, seed=7))
    ]
    alone, engine = [], real_engine(model, cache_tokens=2048, weights="int4")
    for prompt, params in asks:
        request = Request(f"alone {len(alone)}", prompt, params)
        engine.add(request)
        run(engine)
        alone.append(request.output_ids)
    needed = sum(-(-(len(prompt) + 60) // 16) for prompt, _ in asks)
    # Half of what they need: each prompt is asked twice, and the two share its full blocks.
    engine = real_engine(model, cache_tokens=needed * 16 // 2, weights="int4")
    requests = [Request(str(i), prompt, params) for i, (prompt, params) in enumerate(asks)]
    engine.add(*requests)
    run(engine)
    assert engine.stats["preemptions"] > 0
    assert [r.output_ids for r in requests] == alone
    assert [r.prefilled for r in requests] == [len(p) for p, _ in asks]


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about tea.",
    "List three prime numbers.",
    "Explain gravity to a child in two sentences, please, with an example from the kitchen.",
    "Hi",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 12 times 12?",
    "Name a famous painting and its painter, and say in which museum it hangs today.",
]


def test_greedy_decoding_matches_transformers_generate_alone(model):
    prompt = chat(model, QUESTIONS[0])
    engine = real_engine(model)
    request = Request("a", prompt, greedy(32))
    engine.add(request)
    run(engine)
    assert request.output_ids == reference_greedy(model, prompt, 32)


def test_greedy_decoding_matches_transformers_generate_in_a_batch_of_eight(model):
    engine = real_engine(model, step_tokens=48)  # several prefill chunks while others decode
    requests = [Request(f"q{i}", chat(model, q), greedy(32)) for i, q in enumerate(QUESTIONS)]
    for n, request in enumerate(requests):
        engine.add(request)
        if n % 3 == 0:
            engine.step()  # arrivals spread over steps: some join a batch already decoding
    run(engine)
    assert len({len(r.prompt_ids) for r in requests}) > 4
    for request in requests:
        assert request.output_ids == reference_greedy(model, request.prompt_ids, 32), request.request_id


def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_busy_batch(model):
    prompt = chat(model, "Tell me a story.")

    def sampled(seed, neighbours=()):
        engine = real_engine(model)
        for n, other in enumerate(neighbours):
            engine.add(Request(f"n{n}", chat(model, QUESTIONS[n]), SamplingParams(max_tokens=12, temperature=1.0, seed=other)))
        request = Request("x", prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=seed))
        engine.add(request)
        run(engine)
        return request.output_ids

    alone = sampled(1234)
    assert alone == sampled(1234, neighbours=(7, None, 9, 10))
    assert alone != sampled(4321)  # the seed, not the prompt, decided the tokens


def test_cancelling_one_request_mid_batch_leaves_the_others_unchanged(model):
    def outputs_of(cancel):
        engine = real_engine(model)
        requests = [Request(f"q{i}", chat(model, q), SamplingParams(max_tokens=16, temperature=0)) for i, q in enumerate(QUESTIONS[:4])]
        for request in requests:
            engine.add(request)
        for _ in range(4):
            engine.step()
        if cancel:
            engine.cancel("q1")
        run(engine)
        return {r.request_id: r.output_ids for r in requests}, engine

    plain, _ = outputs_of(cancel=False)
    cancelled, engine = outputs_of(cancel=True)
    assert len(cancelled["q1"]) < len(plain["q1"])
    assert {k: v for k, v in cancelled.items() if k != "q1"} == {k: v for k, v in plain.items() if k != "q1"}
    assert engine.pool.reserved == 0 and all(n == 0 for n in engine.pool.refs)  # every block came back


def test_steering_counts_as_prompt_and_changes_the_continuation(model):
    prompt = chat(model, "Write a short story about a cat.")

    def story(steer):
        engine = real_engine(model)
        request = Request("s", prompt, SamplingParams(max_tokens=24, temperature=0))
        engine.add(request)
        outputs = []
        while len(request.output_ids) < 5:
            outputs += engine.step()
        if steer:
            engine.steer("s", " The cat suddenly learned to fly.")
        outputs += run(engine)
        return request, outputs

    plain, _ = story(steer=False)
    steered, outputs = story(steer=True)
    steer_tokens = len(model.tokenizer.encode(" The cat suddenly learned to fly.", add_special_tokens=False))
    assert steered.prefilled == len(prompt) + steer_tokens == plain.prefilled + steer_tokens
    assert steered.output_ids[:5] == plain.output_ids[:5]
    assert steered.output_ids[5:] != plain.output_ids[5:]
    marks = [o for o in outputs if o.steered]
    assert len(marks) == 1 and marks[0].steered == " The cat suddenly learned to fly."


def test_n_choices_share_the_prompt_and_each_repeats_its_own_seed(model):
    prompt = chat(model, "Write a sentence about the sea. " * 6)
    engine = real_engine(model)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=42)
    group = choices("g", prompt, params, n=3)
    engine.add(*group)
    outputs = run(engine)
    assert sorted(o.index for o in outputs if o.finished) == [0, 1, 2]
    tail = len(prompt) - 16 * ((len(prompt) - 1) // 16)  # the prompt's last partial block
    assert engine.stats["computed_prompt_tokens"] == len(prompt) + 2 * tail  # the rest came from the cache
    assert all(r.prefilled == len(prompt) for r in group)
    for i, request in enumerate(group):
        alone = Request("alone", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=42 + i))
        solo = real_engine(model)
        solo.add(alone)
        run(solo)
        assert request.output_ids == alone.output_ids, i
    assert len({tuple(r.output_ids) for r in group}) == 3


def test_cancel_and_steer_reach_every_choice(tokenizer):
    engine, _ = make_engine(tokenizer, {f"g.{i}": ids(tokenizer, " x" * 20) for i in range(2)})
    group = choices("g", [5] * 20, SamplingParams(max_tokens=20, **GREEDY), n=2)
    engine.add(*group)
    while not all(r.output_ids for r in group):
        engine.step()
    assert engine.live_ids() == ["g"]
    engine.steer("g", " more")
    assert sorted(o.index for o in engine.step() if o.steered) == [0, 1]
    engine.cancel("g")
    assert sorted(o.index for o in engine.step() if o.finish_reason == "cancelled") == [0, 1]
    assert not engine.has_work() and all(r.steered_tokens == 1 for r in group)

    engine, _ = make_engine(tokenizer, {"a": ids(tokenizer, " x" * 20)})
    request = Request("a", [5] * 50, SamplingParams(max_tokens=10, **GREEDY))
    engine.add(request)
    engine.step()
    engine.steer("a", " and now a very long instruction that cannot possibly fit in what is left")
    [refusal] = [o for o in engine.step() if o.error]
    assert "steering not applied" in refusal.error and request.steered_tokens == 0


def test_a_shared_prefix_is_computed_once(model):
    system = "You are a meticulous assistant. " * 20
    engine = real_engine(model)

    def ask(request_id, question):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        request = Request(request_id, model.tokenizer.apply_chat_template(messages, add_generation_prompt=True), SamplingParams(max_tokens=4, temperature=0))
        engine.add(request)
        run(engine)
        return request

    first = ask("one", "What is tea?")
    computed_first = engine.stats["computed_prompt_tokens"]
    second = ask("two", "What is coffee?")
    computed_second = engine.stats["computed_prompt_tokens"] - computed_first
    assert first.cached_tokens == 0 and computed_first == len(first.prompt_ids)
    assert second.cached_tokens >= 16 * (len(model.tokenizer.encode(system)) // 16)
    assert computed_second == len(second.prompt_ids) - second.cached_tokens < len(second.prompt_ids) / 4
    assert second.prefilled == len(second.prompt_ids)  # billed as consumed, cached or not


def test_beam_search_matches_transformers_and_never_takes_back_a_streamed_delta(model):
    engine = real_engine(model)
    neighbours = [Request(f"n{i}", chat(model, q), SamplingParams(max_tokens=24, temperature=0)) for i, q in enumerate(QUESTIONS[3:6])]
    beams = [Request(f"b{i}", chat(model, q), SamplingParams(max_tokens=32, beam_width=4)) for i, q in enumerate(QUESTIONS[:3])]
    expected = {r.request_id: reference(model, r.prompt_ids, 32, num_beams=4) for r in beams}
    final = {rid: model.tokenizer.decode(ids, skip_special_tokens=True) for rid, ids in expected.items()}
    engine.add(neighbours[0], beams[0], neighbours[1], beams[1], beams[2], neighbours[2])
    shown = dict.fromkeys(expected, "")
    while engine.has_work():
        for output in engine.step():
            if output.request_id in shown:
                shown[output.request_id] += output.text
                assert final[output.request_id].startswith(shown[output.request_id])  # never taken back
    for request in beams:
        assert request.output_ids == expected[request.request_id], request.request_id
        assert shown[request.request_id] == final[request.request_id]
    for request in neighbours:  # beams sharing the steps leave greedy neighbours as they were
        assert request.output_ids == reference(model, request.prompt_ids, 24)
    assert engine.pool.reserved == 0 and all(n == 0 for n in engine.pool.refs)


def test_a_beam_search_streams_in_several_steps_and_reports_its_ending(model):
    engine = real_engine(model)
    request = Request("b", chat(model, "Hi"), SamplingParams(max_tokens=32, beam_width=3))
    engine.add(request)
    outputs = run(engine)
    assert len([o for o in outputs if o.text]) >= 2
    assert outputs[-1].finish_reason == ("stop" if request.output_ids[-1] in model.stop_ids else "length")
    assert outputs[-1].completion_tokens == len(request.output_ids)


@pytest.mark.parametrize("chunk", [7, 64])
def test_a_long_prompt_is_prefilled_in_chunks_with_the_same_result(model, chunk):
    prompt = chat(model, "Summarise: " + "The quick brown fox jumps over the lazy dog. " * 30)
    engine = real_engine(model, idle_chunk=chunk)
    request = Request("long", prompt, greedy(8))
    engine.add(request)
    run(engine)
    assert engine.stats["steps"] >= len(prompt) // chunk
    assert request.output_ids == reference_greedy(model, prompt, 8)


def test_steering_a_request_whose_choices_still_wait_reaches_each_choice_once(tokenizer):
    engine, _ = make_engine(tokenizer, {f"g.{i}": ids(tokenizer, " x" * 20) for i in range(2)}, idle_chunk=4)
    group = choices("g", [5] * 30, SamplingParams(max_tokens=20, **GREEDY), n=2)
    engine.add(*group)
    engine.step()  # the leader prefills in pieces; choice 1 waits for it
    engine.steer("g", " more")
    run(engine)
    assert [r.steered_tokens for r in group] == [1, 1]


def test_a_failing_forward_pass_ends_every_request_and_keeps_what_ended_before_it(tokenizer):
    engine, runner = make_engine(tokenizer, {"a": ids(tokenizer, " x" * 9), "b": ids(tokenizer, " y" * 9)})
    engine.add(Request("a", [5], SamplingParams(max_tokens=9, **GREEDY)), Request("b", [6], SamplingParams(max_tokens=9, **GREEDY)))
    engine.step()
    engine.cancel("a")
    runner.forward = lambda chunks: 1 / 0
    endings = {o.request_id: o.finish_reason for o in engine.step() if o.finished}
    assert endings == {"a": "cancelled", "b": "error"} and not engine.has_work()


def test_a_beam_search_ends_cleanly_in_a_full_cache_whose_prefix_another_request_holds(tokenizer):
    prompt = list(range(100, 120))
    scripts = {"greedy": ids(tokenizer, " x" * 30), "beams": ids(tokenizer, " y" * 3) + [2]}
    runner = ScriptedRunner(scripts, len(tokenizer), cache_tokens=5 * 16)  # room for both, not one block more
    engine = Engine(runner, tokenizer, stop_ids={2}, context_length=64)
    engine.add(Request("greedy", prompt, SamplingParams(max_tokens=20, **GREEDY)))
    engine.step()  # its prompt blocks are cached and held
    engine.add(Request("beams", prompt, SamplingParams(max_tokens=4, beam_width=2)))
    outputs = run(engine)
    [beams] = [o for o in outputs if o.request_id == "beams" and o.finished]
    assert beams.finish_reason == "stop" and beams.error is None
    assert engine.pool.reserved == 0 and all(n == 0 for n in engine.pool.refs)


def test_a_request_without_a_token_is_told_its_place_in_line_as_the_line_moves(tokenizer):
    """One slot: each request is told how many are in line before it (the one whose prompt is
    being read counts), then that its own prompt is read; later choices of a request say nothing."""
    engine, _ = make_engine(tokenizer, {name: ids(tokenizer, " one two") + [2] for name in ("a", "b.0", "b.1", "c")}, max_running=1, tells_places=True)
    engine.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=5, **GREEDY)))
    engine.add(*choices("b", [8, 9], SamplingParams(max_tokens=5, **GREEDY), n=2))
    engine.add(Request("c", [10], SamplingParams(max_tokens=5, **GREEDY)))
    outputs = run(engine)
    places = [(o.request_id, "reading" if o.reading else o.ahead) for o in outputs if o.reading or o.ahead is not None]
    assert places == [("a", "reading"), ("b.0", 1), ("c", 2), ("b.0", 0), ("c", 1), ("b.0", "reading"), ("c", 0), ("c", "reading")]
    assert all(o.text == "" and not o.finished for o in outputs if o.reading or o.ahead is not None)
    assert text_of(outputs, "b.1") == text_of(outputs, "c") == " one two"
