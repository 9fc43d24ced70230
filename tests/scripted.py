"""A deterministic token source for engine tests: each prompt has a script of tokens."""

import torch


class ScriptedRunner:
    device = torch.device("cpu")

    def __init__(self, scripts, vocab_size):
        self.scripts = scripts  # tuple(prompt_ids) -> the ids to produce, in order
        self.vocab_size = vocab_size
        self.prefills = 0
        self.decodes = 0

    def logits_for(self, token):
        logits = torch.full((self.vocab_size,), -10.0)
        logits[token] = 10.0
        return logits

    def prefill(self, prompt_ids):
        self.prefills += 1
        script = iter(self.scripts[tuple(prompt_ids)])
        return self.logits_for(next(script)), script

    def decode(self, token_id, script):
        self.decodes += 1
        return self.logits_for(next(script))
