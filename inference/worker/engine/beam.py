"""Beam search as transformers' `generate(num_beams=W)` runs it, one step at a time.

Its defaults, kept exactly so the results match token for token: length penalty 1 (a finished
beam scores its summed log-probabilities over its generated length, end token included),
`early_stopping=False` (stop once the best running beam, at its current length, cannot beat
the worst of W finished ones), and per step the best (1 + number of end tokens) x W candidates,
of which only the top W may finish. This class only keeps scores and tokens; the engine runs
the model and forks the beams' KV-cache blocks as `advance` says.
"""

import torch


class BeamSearch:
    def __init__(self, width, max_tokens, stop_ids):
        self.width = width
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.candidates = max(2, 1 + len(self.stop_ids)) * width
        self.running = [[]]  # generated tokens of each live beam; the prompt alone at first
        self.scores = torch.zeros(1)  # [beams], float32 sums of log-probabilities
        self.finished = []  # (normalised score, tokens), best first, at most `width`
        self.done = False

    def advance(self, logits):
        """logits: [len(running), V] -> for each new running beam, the index of its parent."""
        totals = torch.log_softmax(logits.float(), dim=-1) + self.scores[:, None]  # [beams, V]
        count = min(self.candidates, totals.numel())
        top, flat = torch.topk(totals.flatten(), count)
        length = len(self.running[0]) + 1
        normalised = (top / length).tolist()
        ended, picks = [], []
        for rank, (index, score) in enumerate(zip(flat.tolist(), top)):
            parent, token = divmod(index, totals.shape[1])
            if token in self.stop_ids or length >= self.max_tokens:
                if rank < self.width:  # only the best W candidates may finish
                    ended.append((normalised[rank], self.running[parent] + [token]))
            elif len(picks) < self.width:
                picks.append((parent, token, score))
        self._keep_finished(ended)
        self.running = [self.running[parent] + [token] for parent, token, _ in picks]
        self.scores = torch.stack([score for _, _, score in picks]) if picks else torch.zeros(0)
        self.done = not picks or not self._may_improve(length)
        return [parent for parent, _, _ in picks]

    def _keep_finished(self, ended):
        # Earlier entries first: a tie keeps the one already there, as transformers does.
        self.finished = sorted(self.finished + ended, key=lambda entry: entry[0], reverse=True)[: self.width]

    def _may_improve(self, length):
        if len(self.finished) < self.width:
            return True
        return float(self.scores[0] / length) > self.finished[-1][0]

    def agreed(self):
        """The longest prefix every beam that may still win shares: safe to stream."""
        sequences = [*self.running, *(tokens for _, tokens in self.finished)]
        prefix = 0
        while all(len(s) > prefix for s in sequences) and len({s[prefix] for s in sequences}) == 1:
            prefix += 1
        return sequences[0][:prefix] if sequences else []

    def best(self):
        return self.finished[0][1] if self.finished else self.agreed()
