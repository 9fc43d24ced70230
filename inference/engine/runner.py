"""Forward passes of a transformers causal LM, one KV cache per sequence."""

import torch


class HFRunner:
    def __init__(self, model, device):
        self.model = model
        self.device = device

    @torch.inference_mode()
    def prefill(self, prompt_ids):
        """prompt_ids: [T] -> (logits of the next token [V], the sequence's cache)."""
        from transformers import DynamicCache

        cache = DynamicCache()
        input_ids = torch.tensor([prompt_ids], device=self.device)  # [1, T]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], out.past_key_values

    @torch.inference_mode()
    def decode(self, token_id, cache):
        """One token onto an existing cache -> logits [V]; the cache grows in place."""
        input_ids = torch.tensor([[token_id]], device=self.device)  # [1, 1]
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return out.logits[0, -1]
