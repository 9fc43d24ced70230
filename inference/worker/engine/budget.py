"""How many prompt tokens a step may carry beside the sequences that decode.

A step that carries prompt tokens is slower for everyone decoding in it. While no prompt waits
for its first token, the steady budget keeps a step within GAP_BOUND times a plain decode step,
by the step times measured here (never under MIN_PREFILL_TOKENS). While prompts wait, a step may
take GAP_BOUND times a plain step as wide as the batch is about to be, the waiting requests
decoding too: that is the gap every stream will have once they join, so the bound holds against
it. Bounding a burst by the step of the streams decoding now held the many behind the few: the
first of 32 arriving together, decoding a step later, cut every later step to a prompt or less.
"""

MIN_PREFILL_TOKENS = 16  # a step's prefill share however many decode: waiting prompts still advance
# A bigger batch's step costs more, so it carries more prefill for the same relative slowdown.
PREFILL_PER_DECODE = 2
GAP_BOUND = 2.5  # a step with prompt tokens takes at most this many plain decode steps
DECAY = 0.95  # the weight of earlier steps in the cost estimate: the machine's load changes
# A step slower than this many times its expected time was slowed by something else (a garbage
# collection, another process on the cores): it counts as this slow, so that one spike does not
# set the estimate for the hundreds of steps it takes to decay.
OUTLIER = 2.0


class Line:
    """y ~ fixed + slope * x over recent points (least squares, earlier points decayed)."""

    def __init__(self):
        self.sums = [0.0] * 5  # weight, x, y, x², x * y
        self.points = 0

    def add(self, x, y):
        terms = (1.0, x, y, x * x, x * y)
        self.sums = [DECAY * total + term for total, term in zip(self.sums, terms)]
        self.points += 1

    def at(self, x):
        """The fitted y at x; the mean y while every x seen was the same; None before 3 points."""
        weight, sx, sy, sxx, sxy = self.sums
        if self.points < 3:
            return None
        slope = self.slope()
        return sy / weight if slope is None else (sy - slope * sx) / weight + slope * x

    def slope(self):
        weight, sx, sy, sxx, sxy = self.sums
        spread = weight * sxx - sx * sx
        if self.points < 3 or spread <= 1e-6 * max(weight * sxx, 1.0):
            return None
        slope = (weight * sxy - sx * sy) / spread
        return slope if slope > 0 else None


class StepCost:
    """What a step costs, from the steps measured: a line over its rows, a decoding sequence's
    token (or draft) and a prompt token alike. Each is a row through the same matrix products,
    and those cost the same per row (attention over a long context aside, which the decay of
    earlier steps follows); fitted over every step, the line knows wide steps from a burst's
    prompts before any plain step that wide was seen."""

    def __init__(self):
        self.rows = Line()

    def add(self, decode_rows, prompt_tokens, seconds):
        rows = decode_rows + prompt_tokens
        self.rows.add(rows, clipped(seconds, self.rows, rows))

    def plain(self, decoding):
        """A step of `decoding` sequences with no prompt tokens; None before 3 steps."""
        return self.rows.at(decoding)

    def tokens_within(self, bound, decoding, width=None):
        """Prompt tokens a step of `decoding` sequences can carry within `bound` plain steps of
        `width` sequences (`decoding` unless given); None while the line has no slope."""
        now, usual, per_row = self.rows.at(decoding), self.rows.at(width or decoding), self.rows.slope()
        if usual is None or per_row is None:
            return None
        return max(0, int((bound * usual - now) / per_row))

    def draft_share(self, decoding, drafts):
        """How much longer a step of `decoding` sequences gets with `drafts` draft tokens."""
        usual, per_row = self.rows.at(decoding), self.rows.slope()
        if usual is None or per_row is None:
            return None
        return per_row * drafts / usual


def clipped(seconds, line, x):
    """`seconds`, or at most OUTLIER times what `line` expects at `x`. Only a fitted line
    expects anything of an `x` it has not seen: while every step had one size, its mean says
    nothing of a bigger one."""
    if line.slope() is None:
        return seconds
    return min(seconds, OUTLIER * line.at(x))


def prefill_budget(decoding, joining, waiting_tokens, cost, step_tokens, idle_chunk):
    """Prompt tokens for this step. `joining`: running requests without a first token, whose
    prompts are being computed; `waiting_tokens`: the prompt tokens they still need."""
    if not decoding:
        return idle_chunk  # nobody's gap to protect
    bound = cost.tokens_within(GAP_BOUND, decoding)
    steady = max(step_tokens - decoding, PREFILL_PER_DECODE * decoding)
    if bound is not None:  # where a prompt token costs much against a plain step, fewer
        steady = min(steady, bound)
    steady = max(steady, MIN_PREFILL_TOKENS)
    if not waiting_tokens or bound is None:
        return steady
    # Never more than a step with nobody decoding would take.
    joined = min(idle_chunk, cost.tokens_within(GAP_BOUND, decoding, decoding + joining))
    return max(steady, min(waiting_tokens, joined))
