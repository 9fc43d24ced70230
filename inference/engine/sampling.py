"""Sampling as short pure tensor functions (gpt-fast style)."""

from dataclasses import dataclass, field

import torch

# Below this a temperature is greedy: dividing by it would overflow the logits (as in vLLM).
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


def make_generator(seed, device):
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)  # any integer a client sends is a valid seed
    return generator


def top_p_filter(logits, top_p):
    # logits: [V]. Keep the smallest set of tokens whose probability mass reaches top_p.
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def sample(logits, params, generator=None):
    """logits: [V] for one sequence -> the next token id."""
    if params.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    logits = top_p_filter(logits.float() / params.temperature, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
