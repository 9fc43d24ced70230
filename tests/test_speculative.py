"""Prompt-lookup speculative decoding: drafts, their verification, and what a request sees."""

import torch

from inference.worker.engine import Request, SamplingParams
from inference.worker.engine.sampling import make_generator
from inference.worker.engine.speculative import Drafter, accepted, verdict_sampled
from tests.test_engine import chat, real_engine, run

REPEAT = "Repeat this list exactly, one item per line: apples, pears, plums, cherries, lemons, limes, figs, dates, grapes, melons."


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_ending():
    ids = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7]
    assert Drafter().propose(ids, 3) == [3, 4, 2]  # after the latest earlier "6 7", not the first
    assert Drafter().propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert Drafter().propose([1, 2, 9, 9, 1, 2], 2) == [9, 9]


def test_the_index_kept_up_to_date_finds_what_a_fresh_one_finds():
    drafter, ids = Drafter(), []
    for token in [4, 1, 2, 3, 1, 2, 5, 1, 2, 3, 7, 2, 3]:
        ids.append(token)
        assert drafter.propose(ids, 4) == Drafter().propose(ids, 4), ids


def test_rejection_sampling_leaves_the_distribution_as_without_drafts():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = torch.log(p).repeat(3, 1)  # [k + 1, V]: the same distribution at every position
    params = SamplingParams(temperature=1.0)
    generator = make_generator(7, "cpu")
    for draft in ([0, 0], [3, 1]):  # a likely draft, then an unlikely one
        firsts = torch.zeros(4)
        for _ in range(4000):
            tokens = accepted(verdict_sampled(rows, params, draft, generator).tolist(), draft, greedy=False)
            firsts[tokens[0]] += 1
        assert (firsts / firsts.sum() - p).abs().sum() / 2 < 0.03, (draft, firsts)


def speculated(model, prompt, **params):
    engine = real_engine(model)
    request = Request("r", prompt, SamplingParams(**params))
    engine.add(request)
    run(engine)
    return request, engine.stats


def test_greedy_output_with_drafts_is_the_output_without_them_in_fewer_steps(model):
    prompt = chat(model, REPEAT)
    plain, plain_stats = speculated(model, prompt, max_tokens=48, temperature=0, speculative=False)
    drafted, stats = speculated(model, prompt, max_tokens=48, temperature=0)
    assert drafted.output_ids == plain.output_ids
    assert plain_stats["draft_tokens"] == 0
    assert stats["draft_tokens_kept"] >= 10 and stats["steps"] < plain_stats["steps"]
    assert drafted.draft_kept == stats["draft_tokens_kept"] and drafted.drafted == stats["draft_tokens"]


def test_a_stop_string_inside_a_kept_draft_ends_the_reply_where_it_would_without_drafts(model):
    prompt = chat(model, REPEAT)
    plain, _ = speculated(model, prompt, max_tokens=48, temperature=0, stop=["lemons"], speculative=False)
    drafted, stats = speculated(model, prompt, max_tokens=48, temperature=0, stop=["lemons"])
    assert drafted.output_ids == plain.output_ids and drafted.finish_reason == "stop"
    assert stats["draft_tokens_kept"] > 0


def test_a_seeded_sample_takes_no_drafts_so_its_neighbours_cannot_change_it(model):
    _, seeded = speculated(model, chat(model, REPEAT), max_tokens=48, temperature=0.05, seed=3)
    request, unseeded = speculated(model, chat(model, REPEAT), max_tokens=48, temperature=0.05)  # near greedy: it copies
    assert seeded["draft_tokens"] == 0
    assert unseeded["draft_tokens"] > 0 and len(request.output_ids) <= 48


def test_a_request_tries_a_draft_even_where_the_estimate_says_drafts_do_not_pay(model):
    """An estimate made in a bad moment (steps with drafts measured twenty times as slow) is
    not left to keep drafts off: each request's first draft is verified, and measured."""
    engine = real_engine(model)
    for rows, seconds in ((1, 0.010), (5, 0.200), (1, 0.010), (5, 0.200)):
        engine.step_cost.add(rows, 0, seconds)
    assert engine.step_cost.draft_share(1, 4) > 4  # no draft could pay for that
    request = Request("r", chat(model, REPEAT), SamplingParams(max_tokens=48, temperature=0))
    engine.add(request)
    run(engine)
    assert request.draft_kept > 0
