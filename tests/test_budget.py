"""The prefill budget: steady while no prompt waits; while prompts wait, as much as keeps a step
within the gap bound of a plain step as wide as the batch is about to be."""

from inference.worker.engine.budget import GAP_BOUND, MIN_PREFILL_TOKENS, Line, StepCost, prefill_budget

STEADY = dict(step_tokens=24, idle_chunk=512)


def measured(fixed=0.010, per_row=0.0005):
    """Plain steps of several widths and steps with prompt tokens beside 4 decodes, each row
    (a decoding sequence's or a prompt's token) costing `per_row`."""
    cost = StepCost()
    for rows in (1, 2, 4, 8, 4, 2):
        cost.add(rows, 0, fixed + per_row * rows)
    for tokens in (16, 64, 32):
        cost.add(4, tokens, fixed + per_row * (4 + tokens))
    return cost


def test_a_line_is_fitted_to_the_steps_seen():
    line = Line()
    for x in (1, 3, 5):
        line.add(x, 2 + 0.5 * x)
    assert abs(line.at(9) - 6.5) < 1e-9 and abs(line.slope() - 0.5) < 1e-9


def test_the_same_size_every_step_gives_the_mean_and_no_slope():
    line = Line()
    for y in (1.0, 2.0, 3.0):
        line.add(32, y)
    assert line.slope() is None and line.at(32) > 1.0


def test_without_waiting_prompts_the_budget_is_the_steady_one():
    assert prefill_budget(8, 0, 0, measured(), **STEADY) == 16
    assert prefill_budget(0, 3, 900, measured(), **STEADY) == 512  # nobody decodes: the whole chunk


def test_the_budget_grows_with_the_prompts_joining_up_to_the_gap_bound_at_their_width():
    cost = measured()
    one, many = (prefill_budget(4, joining, 10_000, cost, **STEADY) for joining in (1, 8))
    assert 20 < one < many
    fixed, per_token = 0.010, 0.0005
    for joining, tokens in ((1, one), (8, many)):
        within = GAP_BOUND * (fixed + per_token * (4 + joining))  # the plain step once they decode too
        assert abs(fixed + per_token * (4 + tokens) - within) <= per_token  # a step of at most GAP_BOUND of those


def test_the_budget_never_exceeds_what_waits_nor_an_idle_step():
    assert prefill_budget(4, 1, 30, measured(), **STEADY) == 30
    assert prefill_budget(4, 28, 10_000, measured(per_row=0.00001), **STEADY) == 512


def test_the_first_of_a_burst_to_decode_does_not_hold_the_rest_back():
    # This machine, compiled int4: a plain step 7 ms and 1.9 ms a row. 31 prompts of 46 tokens
    # behind one that decodes got 16 tokens a step, bounded by a plain step of that one stream.
    cost = measured(fixed=0.007, per_row=0.0019)
    tokens = prefill_budget(1, 31, 31 * 46, cost, **STEADY)
    assert tokens > 46
    assert 0.007 + 0.0019 * (1 + tokens) <= GAP_BOUND * cost.plain(32)


def test_the_steady_budget_keeps_a_step_within_the_bound_where_prompt_tokens_cost_much():
    # This machine with the integer products: a plain step of 4 rows 7.6 ms, a row 0.9 ms more.
    # The flat 20 tokens beside 4 decodes made every step of a burst 3.2 plain ones.
    cost = measured(fixed=0.004, per_row=0.0009)
    for joining, waiting in ((0, 0), (1, 10_000)):
        tokens = prefill_budget(4, joining, waiting, cost, **STEADY)
        assert tokens == MIN_PREFILL_TOKENS
        assert cost.plain(4) + 0.0009 * tokens < 3 * cost.plain(4)


def test_wide_steps_are_known_from_steps_with_prompt_tokens():
    # In a burst no plain step as wide as the newcomers make it has run yet.
    cost = StepCost()
    for tokens in (0, 0, 0, 20, 20, 16):
        cost.add(4, tokens, 0.004 + 0.0009 * (4 + tokens))
    assert abs(cost.plain(26) - (0.004 + 0.0009 * 26)) < 1e-6


def test_drafts_cost_their_share_of_a_step():
    assert abs(measured().draft_share(1, 4) - 0.002 / 0.0105) < 1e-6


def test_one_slow_step_does_not_set_the_estimate():
    cost, steady = measured(), measured()
    cost.add(4, 0, 0.5)  # a step 30 times its usual time: a collection, another process
    assert cost.draft_share(1, 4) < 1.5 * steady.draft_share(1, 4)
    assert cost.plain(4) < 2.5 * steady.plain(4)
