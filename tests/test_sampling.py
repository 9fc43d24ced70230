import torch

from inference.protocol.payloads import SamplingParams
from inference.worker.engine.sampling import adjusted, choose, make_generator, probabilities


def sample(logits, params, generator=None, seen_ids=(), output_ids=()):
    """One sequence's pick, as the engine makes it: a batch of one."""
    return choose(adjusted(logits, params, seen_ids, output_ids)[None], [params], [generator])[0]


def test_it_takes_the_most_likely_token_at_temperature_zero():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(temperature=0)) == 1


def test_top_p_keeps_only_the_smallest_set_that_reaches_it():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = probabilities(logits, SamplingParams(top_p=0.75)) > 0
    assert kept.tolist() == [True, True, False, False]
    assert (probabilities(logits, SamplingParams(top_p=0.4)) > 0).tolist() == [True, False, False, False]


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


def test_a_row_chooses_the_same_token_alone_and_in_a_batch():
    """Each row its own parameters and seed, beside greedy and unseeded rows: every seeded or
    greedy row's tokens equal the ones it chooses alone, over many steps."""
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=40, seed=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, min_p=0.05, top_k=100, top_p=0.95, seed=4),
        SamplingParams(temperature=1.0, top_p=0.9, seed=5),  # a flat row: its nucleus is most of the vocabulary
    ]
    fixed = [i for i, p in enumerate(params) if p.greedy or p.seed is not None]
    batch_gens = [make_generator(p.seed, "cpu") for p in params]
    alone_gens = [make_generator(p.seed, "cpu") for p in params]
    for _ in range(12):
        logits = torch.randn(len(params), 16384) * 4
        logits[-1] /= 100
        together = choose(logits, params, batch_gens).tolist()
        alone = {i: int(choose(logits[i : i + 1], [params[i]], [alone_gens[i]])[0]) for i in fixed}
        assert {i: together[i] for i in fixed} == alone


def test_top_k_and_top_p_keep_only_what_they_allow():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(top_k=3, top_p=0.95)]
    kept = [(probabilities(row, p) > 0).tolist() for row, p in zip(logits, params)]
    assert kept == [[True, True, False, False], [True, True, False, False], [True, True, True, False]]
    draws = {int(t) for _ in range(200) for t in choose(logits, params, [None] * 3)}
    assert draws <= {0, 1, 2}


def test_a_sampled_row_follows_its_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    generator = make_generator(11, "cpu")
    for params, expected in ((SamplingParams(temperature=1.0), probs), (SamplingParams(top_k=2), torch.tensor([2 / 3, 1 / 3, 0, 0]))):
        draws = [int(choose(probs.log()[None], [params], [generator])[0]) for _ in range(3000)]
        shares = [draws.count(t) / len(draws) for t in range(4)]
        assert all(abs(share - p) < 0.03 for share, p in zip(shares, expected.tolist())), shares
