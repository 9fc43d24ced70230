"""Sampling as short pure tensor functions (gpt-fast style).

Each function works on one sequence's logits and returns tensors, never Python numbers: the
engine collects every sequence's pick of a step and moves them to the host in one transfer.
"""

from dataclasses import dataclass, field

import torch

# Below this a temperature is greedy: dividing by it would overflow the logits (as in vLLM).
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    beam_width: int = 1  # above 1: beam search (deterministic; the sampling knobs do not apply)
    speculative: bool = True  # prompt-lookup drafts where the engine finds them worth it

    @property
    def greedy(self):
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalised(self):
        """The logits depend on the output so far: each token must be seen before the next."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def __post_init__(self):
        # JSON (a Celery message, say) turns integer keys into strings.
        self.logit_bias = {int(token): float(bias) for token, bias in dict(self.logit_bias).items()}


def make_generator(seed, device):
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % 2**64)  # any integer a client sends is a valid seed
    return generator


def apply_penalties(logits, params, seen_ids, output_ids):
    """OpenAI's presence/frequency penalties on generated tokens; the repetition penalty (as in
    transformers and vLLM) on every token seen: prompt, steering and output."""
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1])
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*seen_ids, *output_ids}), dtype=torch.long, device=logits.device)
        scores = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    return logits


def apply_logit_bias(logits, bias):
    if not bias:
        return logits
    ids = torch.tensor(list(bias), device=logits.device)
    return logits.index_add(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device))


def top_k_filter(logits, top_k):
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits, top_p):
    # logits: [V]. Keep the smallest set of tokens whose probability mass reaches top_p.
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def min_p_filter(logits, min_p):
    # Drop tokens less likely than min_p times the most likely one.
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def adjusted(logits, params, seen_ids=(), output_ids=()):
    """logits: [V] -> the logits the choice is made from: penalties and bias applied."""
    return apply_logit_bias(apply_penalties(logits.float(), params, seen_ids, output_ids), params.logit_bias)


def probabilities(logits, params):
    """Adjusted logits [..., V] of a sampled request -> the distribution it draws from."""
    if logits.dim() > 1:
        return torch.stack([probabilities(row, params) for row in logits])
    logits = top_k_filter(logits / params.temperature, params.top_k)
    return torch.softmax(min_p_filter(top_p_filter(logits, params.top_p), params.min_p), dim=-1)


def sample(logits, params, generator=None, seen_ids=(), output_ids=()):
    """logits: [V] for one sequence -> the next token id, as a 0-d tensor."""
    logits = adjusted(logits, params, seen_ids, output_ids)
    if params.greedy:
        return torch.argmax(logits)
    return torch.multinomial(probabilities(logits, params), 1, generator=generator)[0]


def uniform(count, generator, device):
    return torch.rand(count, generator=generator, device=device)
