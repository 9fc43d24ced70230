"""transformers' own generate: the yardstick the engine is held to."""

import torch


def reference(model, prompt, tokens, **options):
    return model.model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=tokens, do_sample=False, eos_token_id=sorted(model.stop_ids), pad_token_id=2, **options,
    )[0, len(prompt):].tolist()  # fmt: skip
