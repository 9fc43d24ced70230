"""Speculative decoding by prompt lookup: drafts from the sequence itself, verified in one pass.

A reply often repeats what came before it (code being edited, a quoted passage, a list that
echoes the question): the tokens that followed the last occurrence of the sequence's final few
tokens are a cheap guess at what comes next. The engine runs the guess through the model with
the sequence's last token, in one forward pass, and keeps the guessed tokens the model agrees
with, plus the one the model itself picks after them, so a step yields one token or several.

Greedy requests keep a draft token while it is the model's argmax: their output is the same as
without drafts. Sampled requests use rejection sampling (Leviathan et al. 2023; Chen et al.
2023) with the draft as a point mass: draft token d is kept with probability p(d), and on its
rejection the token is drawn from p with d removed, which leaves the output distributed exactly
as without drafts.
"""

import torch

from .sampling import adjusted, probabilities, uniform

MAX_NGRAM = 3  # the longest ending looked up first: a longer match predicts better
MIN_NGRAM = 2  # one token alone matches too often to predict anything


class Drafter:
    """An index of the sequence's n-grams, kept up to date as the sequence grows, so a lookup
    costs the same at token 10 and at token 10,000."""

    def __init__(self):
        self.indexed = 0  # positions whose preceding n-grams are in the index
        self.latest = {}  # n-gram -> the position just after its latest occurrence

    def propose(self, ids, size):
        """Up to `size` tokens that followed the latest earlier occurrence of ids' ending."""
        self._index(ids)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            position = self.latest.get(tuple(ids[-n:]))
            if position is not None:
                return ids[position : position + size]
        return []

    def _index(self, ids):
        # A position counts once the token at it exists: it gives the n-gram a continuation.
        for position in range(max(self.indexed, MIN_NGRAM), len(ids)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, position) + 1):
                self.latest[tuple(ids[position - n : position])] = position
        self.indexed = max(self.indexed, len(ids))


def verdict_greedy(rows, params):
    """rows: [k + 1, V] logits after the last token and each draft token -> the model's own
    pick at each position: [k + 1]. The host keeps drafts while they equal these."""
    return torch.stack([adjusted(row, params) for row in rows]).argmax(-1)


def verdict_sampled(rows, params, draft, generator):
    """-> [1 + (k + 1)]: the count of draft tokens kept, then for each position the token to
    take if the drafts stop there (drawn from p with the rejected draft token removed; the
    last row, after every draft was kept, from p itself)."""
    probs = probabilities(torch.stack([adjusted(row, params) for row in rows]), params)  # [k + 1, V]
    k = len(draft)
    drafted = torch.tensor(draft, device=rows.device)
    kept = uniform(k, generator, rows.device) < probs[torch.arange(k), drafted]
    residual = probs.clone()
    residual[torch.arange(k), drafted] = 0
    empty = residual.sum(-1, keepdim=True) <= 0  # p was all on the draft token: it is always kept
    residual = torch.where(empty, probs, residual)
    replacements = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return torch.cat([kept.long().cumprod(0).sum()[None], replacements])


def accepted(verdict, draft, greedy):
    """A verdict, on the host -> the tokens this step yields: the kept drafts and one more."""
    if greedy:
        count = next((i for i, (d, pick) in enumerate(zip(draft, verdict)) if d != pick), len(draft))
        return draft[:count] + [verdict[count]]
    count = verdict[0]
    return draft[:count] + [verdict[1 + count]]
