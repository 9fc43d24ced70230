import torch

from inference.worker.engine.sampling import (
    SamplingParams,
    make_generator,
    sample,
    top_p_filter,
)


def test_it_takes_the_most_likely_token_at_temperature_zero():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(temperature=0)) == 1


def test_top_p_keeps_only_the_smallest_set_that_reaches_it():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(top_p_filter(logits, 0.75))
    assert kept.tolist() == [True, True, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.4)).tolist() == [True, False, False, False]


def test_a_seed_repeats_its_draws():
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0)
    gen_a, gen_b = make_generator(3, "cpu"), make_generator(3, "cpu")
    a = [sample(logits, params, gen_a) for _ in range(20)]
    b = [sample(logits, params, gen_b) for _ in range(20)]
    assert a == b
    assert len(set(a)) > 10  # a flat distribution really was sampled


def test_any_integer_is_a_seed():
    for seed in (-1, 2**64, 2**80):
        assert 0 <= sample(torch.zeros(10), SamplingParams(temperature=1.0), make_generator(seed, "cpu")) < 10


def test_a_tiny_temperature_is_greedy_not_a_crash():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(temperature=1e-40)) == 1


def test_the_repetition_penalty_covers_every_token_seen_not_only_the_output():
    logits = torch.tensor([0.0, 2.0, 1.5, 0.0])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, params, seen_ids=[], output_ids=[]) == 1
    assert sample(logits, params, seen_ids=[1], output_ids=[]) == 2  # a prompt or steering token
