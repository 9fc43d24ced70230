"""How many prompt tokens a step may carry beside the sequences that decode.

A step that carries prompt tokens is slower for everyone decoding in it. A small budget keeps
their inter-token gap steady but makes requests that arrive together wait for each other's
prompts; so the budget grows while prompts wait, and more the longer they have waited, up to
what keeps a step within GAP_BOUND times a plain decode step, by the step times measured here.
"""

MIN_PREFILL_TOKENS = 16  # a step's prefill share however many decode: waiting prompts still advance
# A bigger batch's step costs more, so it carries more prefill for the same relative slowdown.
PREFILL_PER_DECODE = 2
GAP_BOUND = 2.5  # a step with prompt tokens takes at most this many plain decode steps
FULL_URGENCY_SECONDS = 0.5  # a prompt waiting this long gets the whole bound
DECAY = 0.9  # the weight of earlier steps in the cost estimate: the machine's load changes


class StepCost:
    """seconds ~ fixed + per_token * tokens, fitted to recent steps (least squares, decayed)."""

    def __init__(self):
        self.sums = [0.0] * 5  # weight, tokens, seconds, tokens², tokens * seconds

    def add(self, tokens, seconds):
        terms = (1.0, tokens, seconds, tokens * tokens, tokens * seconds)
        self.sums = [DECAY * total + term for total, term in zip(self.sums, terms)]

    def line(self):
        """(fixed, per_token), or None until the steps seen differ enough in size."""
        weight, x, y, xx, xy = self.sums
        spread = weight * xx - x * x
        if weight < 3 or spread <= 1e-9 * max(weight * xx, 1.0):
            return None
        per_token = (weight * xy - x * y) / spread
        fixed = (y - per_token * x) / weight
        return (max(fixed, 0.0), per_token) if per_token > 0 else None

    def tokens_within(self, bound, decoding):
        """Prompt tokens a step of `decoding` sequences can carry within `bound` plain steps."""
        line = self.line()
        if line is None:
            return 0
        fixed, per_token = line
        usual = fixed + per_token * decoding
        return int((bound - 1) * usual / per_token)


def prefill_budget(decoding, waiting_tokens, oldest_wait, cost, step_tokens, idle_chunk):
    """Prompt tokens for this step. `waiting_tokens`: prompt tokens not yet computed of requests
    without a first token; `oldest_wait`: seconds the oldest of them has waited."""
    if not decoding:
        return idle_chunk  # nobody's gap to protect
    steady = max(step_tokens - decoding, MIN_PREFILL_TOKENS, PREFILL_PER_DECODE * decoding)
    if not waiting_tokens:
        return steady
    urgency = min(1.0, oldest_wait / FULL_URGENCY_SECONDS)
    bound = cost.tokens_within(GAP_BOUND, decoding)
    return max(steady, min(waiting_tokens, int(steady + urgency * (bound - steady))))
