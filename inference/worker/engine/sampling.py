"""Sampling as short pure tensor functions (gpt-fast style).

The step's sequences choose together: one argmax for the greedy rows, a few operations over
the batch for the sampled ones, each row with its own parameters and generator, and the
results stay tensors, so the engine moves every pick of a step to the host in one transfer.
Only a request's own adjustments (penalties, a logit bias) are applied row by row.
"""

import torch

# Tokens a top-k or top-p row is cut from first (its nucleus is almost always among them).
CANDIDATES = 1024
NO_TOKEN = -1  # what choose picks for a row with no distribution to draw from (NaN logits)


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


def adjusted(logits, params, seen_ids=(), output_ids=()):
    """logits: [V] -> the logits the choice is made from: penalties and bias applied."""
    return apply_logit_bias(apply_penalties(logits.float(), params, seen_ids, output_ids), params.logit_bias)


def processed(params):
    """The request's logits are more than the model's (penalties, a bias): its row goes through adjusted."""
    return params.penalised or bool(params.logit_bias)


def column(values, like):
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [B, 1]


def narrows(params, vocabulary):
    """The row keeps only its most likely tokens: it needs them in order."""
    return 0 < params.top_k < vocabulary or params.top_p < 1.0


def choose(logits, params, generators):
    """logits: [B, V], adjusted, one SamplingParams and generator (or None) each -> [B] token
    ids: an argmax for the greedy rows, a draw for the others, as a few operations over the
    batch. Every operation works along a row, and a seeded row draws one number a token from
    its own generator, so its tokens are the same alone or beside any others. A row whose
    logits are not numbers, or all -inf, gets NO_TOKEN."""
    unusable = ~(logits.amax(-1) > float("-inf"))  # amax passes a NaN on
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):
        return logits.argmax(-1).masked_fill(unusable, NO_TOKEN)
    picks = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if greedy:
        picks[greedy] = logits[greedy].argmax(-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    picks[drawn] = draw(logits[drawn], [params[i] for i in drawn], uniforms([generators[i] for i in drawn], logits.device))
    return picks.masked_fill(unusable, NO_TOKEN)


def draw(logits, params, u):
    """Sampled rows [B, V] -> [B] tokens, each by inverting its distribution's cumulative sum
    at its own uniform number u."""
    vocabulary = logits.shape[-1]
    z = logits / column([p.temperature for p in params], logits)
    picks = torch.empty(len(params), dtype=torch.long, device=logits.device)
    whole = [i for i, p in enumerate(params) if not narrows(p, vocabulary)]
    if whole:
        picks[whole] = inverse_cdf(min_p_cut(torch.softmax(z[whole], dim=-1), [params[i] for i in whole]), u[whole])
    cut = [i for i, p in enumerate(params) if narrows(p, vocabulary)]
    if cut:
        picks[cut] = draw_narrowed(z[cut], [params[i] for i in cut], u[cut])
    return picks


def draw_narrowed(z, params, u):
    """Rows with top-k or top-p: cut from their CANDIDATES most likely tokens, which a full
    sort of the vocabulary costs ~10 times more than finding on the CPU; a row whose nucleus
    reaches past them is drawn again from all of its tokens in order. Whether it does is the
    row's own numbers', so a row takes the same path alone or in a batch."""
    size = CANDIDATES if z.device.type == "cpu" else z.shape[-1]  # a GPU sorts fast, and reading `fits` would wait for it
    weights, ids, fits = nucleus(z, params, size)
    picks = ids.gather(1, inverse_cdf(weights, u)[:, None])[:, 0]
    wide = [i for i, fit in enumerate(fits.tolist()) if not fit]
    if wide:
        weights, ids, _ = nucleus(z[wide], [params[i] for i in wide], z.shape[-1])
        picks[wide] = ids.gather(1, inverse_cdf(weights, u[wide])[:, None])[:, 0]
    return picks


def nucleus(z, params, size):
    """Rows [B, V] of tempered logits -> (weights [B, size], ids [B, size], fits [B]): each
    row's `size` most likely tokens in order with what each weighs after top-k, then top-p over
    what top-k kept, then min-p (as vLLM), and whether the row's nucleus lay within them."""
    vocabulary = z.shape[-1]
    top, ids = torch.topk(z, min(size, vocabulary), dim=-1)  # sorted, most likely first
    k = torch.tensor([p.top_k if 0 < p.top_k < vocabulary else vocabulary for p in params], device=z.device)[:, None]
    outside = torch.arange(top.shape[-1], device=z.device)[None, :] >= k
    top = top.masked_fill(outside, float("-inf"))
    # Normalised over the top k alone, or over the whole vocabulary when there is no top-k.
    norm = torch.where(k < vocabulary, torch.logsumexp(top, -1, keepdim=True), torch.logsumexp(z, -1, keepdim=True))
    probs = torch.exp(top - norm)
    mass, top_p = probs.cumsum(-1), column([p.top_p for p in params], probs)
    probs = probs.masked_fill((mass - probs >= top_p) & (top_p < 1.0), 0.0)
    k, size = k[:, 0], top.shape[-1]
    fits = torch.where(k < vocabulary, k <= size, mass[:, -1] >= top_p[:, 0]) | (size == vocabulary)
    return min_p_cut(probs, params), ids, fits


def min_p_cut(probs, params):
    """Drop tokens less likely than min_p times the most likely one."""
    if not any(p.min_p > 0 for p in params):
        return probs
    return probs.masked_fill(probs < column([p.min_p for p in params], probs) * probs.amax(-1, keepdim=True), 0.0)


def inverse_cdf(weights, u):
    """[B, C] non-negative weights, [B] uniform numbers in [0, 1) -> [B] positions: the first
    whose running total passes u times the row's total (a zero weight is never picked)."""
    cdf = weights.cumsum(-1)
    positions = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return positions.clamp_(max=weights.shape[-1] - 1)


def uniforms(generators, device):
    """[B] uniform numbers: a seeded row's from its own generator, the others' in one call."""
    u = torch.rand(len(generators), device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = uniform(1, generator, device)[0]
    return u


def probabilities(logits, params):
    """Adjusted logits [V] or [k, V] of one sampled request -> the distribution it draws from
    (for verifying drafts, which need every token's probability)."""
    rows = logits.reshape(-1, logits.shape[-1]).float()
    z = rows / params.temperature
    if narrows(params, z.shape[-1]):
        weights, ids, _ = nucleus(z, [params] * len(z), z.shape[-1])
        weights = torch.zeros_like(z).scatter_(-1, ids, weights)
    else:
        weights = min_p_cut(torch.softmax(z, dim=-1), [params] * len(z))
    return (weights / weights.sum(-1, keepdim=True)).reshape(logits.shape)


def uniform(count, generator, device):
    return torch.rand(count, generator=generator, device=device)
