"""The forward pass of a Llama-family model, computed by the engine itself over the paged KV cache.

transformers loads the weights and stays the reference; this module lays them out once for
decoding (q, k and v in one matrix, gate and up in another, in the weight formats that measured
fastest on this device: one for generated tokens, one for prompt tokens) and runs each step with
its own RMSNorm, rotary embedding and paged attention: one matrix product per projection and
format for every token of the step, and no module calls.
"""

import logging
import math
import time

import torch
import torch.nn.functional as F

from .kv_cache import head_dim_of
from .runner import AttentionPlan, PagedAttention

log = logging.getLogger(__name__)
INT4_GROUP = 32  # the GGUF's own Q4_1 blocks are 32 weights with a scale and a minimum
# A matrix that int4 would change by more than this (relative to its norm) goes to int8: the
# GGUF's 4-bit matrices come back almost exactly, its 6- or 8-bit ones (the embedding) do not.
INT4_MAX_ERROR = 0.01
FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")


class Linear:
    """y = x @ W.T (+ b); x and y in the model's dtype, W in the format's own."""

    bias = None
    act_dtype = None

    def __call__(self, x):
        y = self.mm(x.to(self.act_dtype)).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Dense(Linear):
    def __init__(self, weight, dtype):
        self.weight, self.act_dtype = weight.to(dtype).contiguous(), dtype

    def mm(self, x):
        return F.linear(x, self.weight)


class Int8(Linear):
    """Weight-only int8, one scale per output row; the CPU kernel wants bfloat16 activations."""

    act_dtype = torch.bfloat16

    def __init__(self, weight):
        weight = weight.float()
        scale = weight.abs().amax(1).clamp(min=1e-8) / 127
        self.weight = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(torch.bfloat16)

    def mm(self, x):
        return torch._weight_int8pack_mm(x, self.weight, self.scale)


class Int4(Linear):
    """Weight-only int4 in groups of 32 along the input, each with a scale and a minimum, the
    layout of the GGUF's Q4_1: weights dequantized from it come back almost exactly."""

    act_dtype = torch.bfloat16

    def __init__(self, weight):
        rows, cols = weight.shape
        groups = weight.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=1e-8)
        codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).reshape(rows, cols)
        # The kernel computes (code - 8) * scale + zero.
        zero = low + 8 * scale
        self.scales = torch.cat([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [groups, rows, 2]
        self.weight = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
        restored = (codes.reshape(groups.shape) - 8) * scale + zero
        self.error = float((restored.reshape(rows, cols) - weight).norm() / weight.float().norm().clamp(min=1e-8))

    @staticmethod
    def fits(weight):
        return weight.device.type == "cpu" and weight.shape[1] % (INT4_GROUP * 2) == 0 and weight.shape[0] % 16 == 0

    def mm(self, x):
        return torch._weight_int4pack_mm_for_cpu(x, self.weight, INT4_GROUP, self.scales)


def linear(weight, fmt, bias=None):
    """weight: [out, in] in the model's dtype -> a Linear in `fmt`."""
    if fmt == "int8":
        layer = Int8(weight)
    elif fmt == "int4":
        layer = Int4(weight) if Int4.fits(weight) else None
        if layer is None or layer.error > INT4_MAX_ERROR:  # a shape the kernel cannot take, or too coarse
            layer = Int8(weight)
    else:
        layer = Dense(weight, getattr(torch, fmt))
    layer.bias, layer.in_features = bias, weight.shape[1]
    return layer


def fused(modules, share):
    """One matrix for several projections. With `share`, the modules' own weights become
    views of it, so that the model in its own dtype is not held twice."""
    weight = torch.cat([m.weight.detach() for m in modules])
    if share:
        offset = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[offset : offset + rows]
            offset += rows
    biases = [m.bias for m in modules]
    return weight, None if biases[0] is None else torch.cat(biases).detach()


class Layer:
    def __init__(self, block, fmt):
        attn, mlp = block.self_attn, block.mlp
        share = fmt == str(attn.q_proj.weight.dtype).removeprefix("torch.")
        self.input_norm = block.input_layernorm.weight.detach()
        self.post_norm = block.post_attention_layernorm.weight.detach()
        weight, bias = fused([attn.q_proj, attn.k_proj, attn.v_proj], share)
        self.qkv = linear(weight, fmt, bias)
        self.o = linear(attn.o_proj.weight.detach(), fmt, attn.o_proj.bias)
        self.gate_up = linear(fused([mlp.gate_proj, mlp.up_proj], share)[0], fmt)
        self.down = linear(mlp.down_proj.weight.detach(), fmt)


class LlamaWeights:
    """The model's weights laid out for decoding, in one format."""

    def __init__(self, model, fmt):
        body, config = model.model, model.config
        self.format = fmt
        self.eps = config.rms_norm_eps
        self.embed = body.embed_tokens.weight.detach()
        self.norm = body.norm.weight.detach()
        self.layers = [Layer(block, fmt) for block in body.layers]
        self.lm_head = linear(model.lm_head.weight.detach(), fmt)
        self.timings = {}

    @classmethod
    def of(cls, model, fmt):
        """Built once per model and format: engines over the same model share them."""
        built = model.__dict__.setdefault("_tokstream_weights", {})
        if fmt not in built:
            built[fmt] = cls(model, fmt)
        return built[fmt]

    def linears(self):
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]


def rms_norm(x, weight, eps):
    """As transformers' LlamaRMSNorm, so float32 decoding matches `generate` token for token."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x, cos, sin):
    """x: [N, H, D]; cos, sin: [N, 1, D] (rotate_half, as transformers)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


def rotary_table(model, length, device):
    """cos and sin of every position once: [length, D] each, from the model's own rotary
    embedding, so any rope scaling it was configured with applies."""
    positions = torch.arange(length, device=device)[None]
    probe = torch.zeros(1, dtype=model.dtype, device=device)
    cos, sin = model.model.rotary_emb(probe, positions)
    return cos[0], sin[0]


class LlamaRunner:
    """forward(chunks) -> logits, for the engine; see runner.AttentionPlan for the chunks.

    Decoding rows (one token of a sequence, or a draft to verify) and prompt rows may read the
    weights in different formats: one token is bound by weight bytes, hundreds by arithmetic,
    and what is fastest for each is measured at load. Every prompt token takes the prefill
    format and every generated one the decoding format, however steps are split, so that a
    sequence's keys and values (and a prefix cached from another request) never depend on
    its neighbours."""

    verifies_drafts = True  # gives logits after every token of a chunk that asks

    def __init__(self, model, pool, device, context_length, fmt="auto"):
        config = model.config
        self.pool = pool
        self.device = device
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.attention = PagedAttention(pool, self.kv_heads, self.head_dim, device)
        self.decoding, self.prefilling = formats_for(model, fmt, device)
        self.format = self.decoding.format
        self.cos, self.sin = rotary_table(model, context_length, device)

    @torch.inference_mode()
    def forward(self, chunks):
        """-> logits [rows, V]: for each chunk the row after its last token, or after each of
        its tokens for a chunk that asks for all of them (a speculative draft to verify)."""
        w, plan = self.decoding, AttentionPlan(chunks, self.pool.block_size, self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)  # [N]
        positions = torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in chunks]).to(self.device)
        x = F.embedding(ids, w.embed)  # [N, hidden]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [N, 1, D]
        sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        n, split = len(ids), plan.decode_rows
        for index, (layer, wide) in enumerate(zip(w.layers, self.prefilling.layers)):
            q, k, v = rows_through(layer.qkv, wide.qkv, rms_norm(x, layer.input_norm, w.eps), split).split(sizes, dim=-1)
            q = rotate(q.view(n, self.heads, self.head_dim), cos, sin)
            k = rotate(k.view(n, self.kv_heads, self.head_dim), cos, sin)
            self.pool.k[index].index_copy_(0, plan.slots, k)
            self.pool.v[index].index_copy_(0, plan.slots, v.view(n, self.kv_heads, self.head_dim))
            x = x + rows_through(layer.o, wide.o, self.attention(index, q, plan), split)
            gate, up = rows_through(layer.gate_up, wide.gate_up, rms_norm(x, layer.post_norm, w.eps), split).chunk(2, dim=-1)
            x = x + rows_through(layer.down, wide.down, F.silu(gate) * up, split)
        return rows_through(w.lm_head, self.prefilling.lm_head, rms_norm(x[plan.logit_rows], w.norm, w.eps), plan.decode_logits)


def rows_through(narrow, wide, x, split):
    """The first `split` rows through the decoding format's layer, the rest through the
    prefill format's."""
    if narrow is wide or split >= len(x):
        return narrow(x)
    if split <= 0:
        return wide(x)
    return torch.cat([narrow(x[:split]), wide(x[split:])])


# -- choosing the weight formats by measuring them --------------------------------------------

_chosen = {}  # (model, device) -> (decoding format, prefill format)
PREFILL_TOKENS = 256  # a prefill step's size, for timing the formats


def candidates(model, device):
    """Formats worth timing here. The CPU's packed int kernels exist in every torch build, but
    whether they beat float32 depends on the CPU: only a measurement tells."""
    own = str(model.dtype).removeprefix("torch.")
    if device.type != "cpu":
        return [own]
    return list(dict.fromkeys([own, "float32", "bfloat16", "int8", "int4"]))


def formats_for(model, fmt, device):
    """(decoding weights, prefill weights): `fmt` for both, or with `auto` the fastest here."""
    if fmt != "auto":
        weights = LlamaWeights.of(model, fmt)
        return weights, weights
    key = (id(model), str(device))
    if key not in _chosen:
        _chosen[key] = fastest(model, candidates(model, device), device)
    return tuple(LlamaWeights.of(model, chosen) for chosen in _chosen[key])


def fastest(model, formats, device):
    """For decoding, the format whose linear layers run fastest for one stream and for 32 at
    once, by the geometric mean of the two (one stream is bound by weight bytes, 32 by
    arithmetic); for prefill, the fastest at PREFILL_TOKENS tokens."""
    timings = {}
    for fmt in formats:
        weights = LlamaWeights.of(model, fmt)
        timings[fmt] = [linears_time(weights, tokens, model, device) for tokens in (1, 32, PREFILL_TOKENS)]
    decoding = min(formats, key=lambda fmt: score(timings[fmt]))
    prefill = min(formats, key=lambda fmt: timings[fmt][2])
    for fmt in set(formats) - {decoding, prefill}:
        model.__dict__["_tokstream_weights"].pop(fmt)  # measured, not kept
    LlamaWeights.of(model, decoding).timings = timings
    log.info("weights: %s for decoding, %s for prefill; linear layers per step at 1 / 32 / %d tokens: %s", decoding, prefill, PREFILL_TOKENS, describe(timings))
    return decoding, prefill


def score(times):
    return math.sqrt(times[0] * times[1])


def describe(timings):
    return ", ".join(f"{fmt} " + " / ".join(f"{t * 1e3:.1f}" for t in times) + " ms" for fmt, times in timings.items())


@torch.inference_mode()
def linears_time(weights, batch, model, device, repeats=5):
    """The best of a few passes through every linear layer at `batch` tokens. At prefill sizes
    the time is arithmetic, not reading weights, and the layers are alike: the first layer's
    time counts for each (every layer would add seconds to a worker's start)."""
    layers = weights.linears()
    inputs = {size: torch.randn(batch, size, dtype=model.dtype, device=device) for size in {layer.in_features for layer in layers}}
    if batch < PREFILL_TOKENS:
        return best_pass(layers, inputs, device, repeats)
    return best_pass(layers[:4], inputs, device, 2) * len(weights.layers) + best_pass([weights.lm_head], inputs, device, 2)


def best_pass(layers, inputs, device, repeats):
    best = math.inf
    for _ in range(repeats + 1):  # the first pass warms the kernels up
        start = time.perf_counter()
        for layer in layers:
            layer(inputs[layer.in_features])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
