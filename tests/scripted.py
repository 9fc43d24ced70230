"""A deterministic token source for engine tests: each request has a script of tokens."""

import torch

from inference.worker.engine.kv_cache import BlockPool


class ScriptedRunner:
    device = torch.device("cpu")

    def __init__(self, scripts, vocab_size, cache_tokens=4096):
        self.scripts = scripts  # request id -> the ids it produces, in order
        self.vocab_size = vocab_size
        self.pool = BlockPool(1, cache_tokens // 16, 16, 1, 1, torch.float32, "cpu")
        self.prompt_lengths = {}
        self.computed = 0

    def logits_for(self, token):
        """Certain of `token`; None gives logits no sampler can use."""
        if token is None:
            return torch.full((self.vocab_size,), float("nan"))
        logits = torch.full((self.vocab_size,), -10.0)
        logits[token] = 10.0
        return logits

    def forward(self, chunks):
        return torch.stack([self.next_logits(chunk) for chunk in chunks])

    def next_logits(self, chunk):
        end = chunk.start + len(chunk.token_ids)
        self.computed += len(chunk.token_ids)
        prompt = self.prompt_lengths.setdefault(chunk.request_id, end)  # short prompts: one chunk
        script, produced = self.scripts[chunk.request_id], end - prompt
        return self.logits_for(script[produced] if produced < len(script) else None)
