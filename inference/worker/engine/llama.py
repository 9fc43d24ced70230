"""The forward pass of a Llama-family model, computed by the engine itself over the paged KV cache.

transformers loads the weights and stays the reference; this module lays them out once for
decoding (q, k and v in one matrix, gate and up in another, in one weight format: formats.py
chooses it) and runs each step with its own RMSNorm, rotary embedding and paged attention: one
matrix product per projection for every token of the step, and no module calls.
"""

import torch
import torch.nn.functional as F

from inference.model_files import head_dim_of

from . import cpu_ops
from .cpu_ops import BLOCK
from .runner import AttentionPlan, PagedAttention

INT4_GROUP = 32  # the GGUF's own Q4_1 blocks are 32 weights with a scale and a minimum
# A matrix that int4 would change by more than this (relative to its norm) goes to int8: the
# GGUF's 4-bit matrices come back almost exactly, its 6- or 8-bit ones (the embedding) do not.
INT4_MAX_ERROR = 0.01
FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
# The CPU's float matrix product rounds a row by how many rows come with it when they are few
# (1, 2, 3 or 5 rows differed from 300 here; 4 and 8 or more did not): a step of fewer rows is
# padded to this many, which costs little where reading the weights bounds the step.
MIN_ROWS = 8


class Linear:
    """y = x @ W.T (+ b); x and y in the model's dtype, W in the format's own. The product is a
    function of the layer's tensors (`apply`), so that one compiled layer serves every layer
    of the model, each passing its own (compiled.py)."""

    bias = None
    act_dtype = None

    def __call__(self, x):
        return self.apply(x, *self.tensors())

    def tensors(self):
        return (*self.weights(), *(() if self.bias is None else (self.bias,)))

    def apply(self, x, *tensors):
        weights = tensors[: len(tensors) - (self.bias is not None)]
        y = self.mm(x.to(self.act_dtype), *weights).to(x.dtype)
        return y if self.bias is None else y + tensors[-1]

    def signature(self):
        """What a compiled layer takes as given: the same for layers it can serve alike."""
        return type(self), self.act_dtype, self.bias is None


class Dense(Linear):
    def __init__(self, weight, dtype):
        self.weight, self.act_dtype = weight.to(dtype).contiguous(), dtype

    def weights(self):
        return (self.weight,)

    @staticmethod
    def mm(x, weight):
        if x.device.type != "cpu":
            return F.linear(x, weight)
        if torch.compiler.is_compiling():  # one program for any number of rows: pad them all
            return F.linear(torch.cat([x, x.new_zeros(MIN_ROWS - 1, x.shape[1])]), weight)[: len(x)]
        if len(x) >= MIN_ROWS:
            return F.linear(x, weight)
        padded = torch.cat([x, x.new_zeros(MIN_ROWS - len(x), x.shape[1])])
        return F.linear(padded, weight)[: len(x)]


class Int8(Linear):
    """Weight-only int8, one scale per output row, through torch's kernel: it wants bfloat16
    activations."""

    act_dtype = torch.bfloat16

    def __init__(self, weight):
        weight = weight.float()
        scale = weight.abs().amax(1).clamp(min=1e-8) / 127
        self.weight = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.scale = scale.to(self.act_dtype)

    def weights(self):
        return self.weight, self.scale

    @staticmethod
    def mm(x, weight, scale):
        return torch._weight_int8pack_mm(x, weight, scale)


def fits_operators(weight):
    return weight.device.type == "cpu" and weight.shape[1] % INT4_GROUP == 0 and weight.shape[0] % BLOCK == 0 and cpu_ops.available()


def by_lanes(values):
    """[out, in] -> [out / 8, in / 32, 8, 8, 4], the CPU operators' layout: for each block of
    eight outputs and group of 32 inputs, vector k holds each output's inputs 4k to 4k + 3,
    one output to a lane of four bytes, so that a lane's multiply-adds are its output's own."""
    out, inputs = values.shape
    return values.reshape(out // BLOCK, BLOCK, inputs // INT4_GROUP, 8, 4).permute(0, 2, 3, 1, 4)


def from_lanes(lanes):
    """by_lanes undone: [out / 8, in / 32, 8, 8, 4] -> [out, in]."""
    blocks, groups = lanes.shape[:2]
    return lanes.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK, groups * INT4_GROUP)


def groups_by_lanes(values):
    """[out, groups] -> [out / 8, groups, 8]: a block's eight outputs side by side for each group."""
    return values.reshape(len(values) // BLOCK, BLOCK, -1).permute(0, 2, 1).contiguous()


class OwnInt8(Int8):
    """The same weights through the engine's own CPU operator (quantized_linear.cpp): x in
    groups of 32 quantized to int8 as llama.cpp does, and integer products against the weights
    laid out in blocks of eight outputs (by_lanes). torch's kernel converts every activation to
    bfloat16 and multiplies in floats, at a fraction of the speed."""

    act_dtype = torch.float32

    def __init__(self, weight):
        super().__init__(weight)
        lanes = by_lanes(self.weight)
        self.weight = lanes.reshape(*lanes.shape[:2], -1).contiguous()

    fits = staticmethod(fits_operators)

    def dense(self):
        """The weights the layer multiplies by, [out, in] float64 (for tests and benchmarks)."""
        return from_lanes(self.weight.reshape(*self.weight.shape[:2], 8, BLOCK, 4)).double() * self.scale.double()[:, None]

    @staticmethod
    def mm(x, weight, scale):
        return torch.ops.tokstream.int8_linear(x, weight, scale)


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

    def weights(self):
        return self.weight, self.scales

    @staticmethod
    def mm(x, weight, scales):
        return torch._weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, scales)


class OwnInt4(Linear):
    """Int4 in the GGUF's Q4_1 groups (32 inputs, each with a float16 scale and minimum, as the
    GGUF keeps them) through the engine's own CPU operator: x quantized to int8 in groups of
    32 as llama.cpp does, and integer products against the codes laid out in blocks of eight
    outputs (by_lanes), two to a byte. A weight is read in five eighths of a byte."""

    act_dtype = torch.float32

    def __init__(self, weight):
        rows, cols = weight.shape
        groups = weight.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
        low = groups.amin(-1, keepdim=True).half().float()
        scale = ((groups.amax(-1, keepdim=True) - low) / 15).clamp(min=2**-14).half().float()  # 2**-14: float16's smallest full-precision number
        codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.uint8)
        restored = (codes * scale + low).reshape(rows, cols)
        self.error = float((restored - weight).norm() / weight.float().norm().clamp(min=1e-8))
        lanes = by_lanes(codes.reshape(rows, cols))  # vectors 0 to 3 in the low halves, 4 to 7 in the high
        self.codes = (lanes[:, :, :4] | (lanes[:, :, 4:] << 4)).reshape(rows // BLOCK, cols // INT4_GROUP, -1).contiguous()
        self.scales, self.minimums = (groups_by_lanes(t.reshape(rows, -1).half()) for t in (scale, low))

    fits = staticmethod(fits_operators)

    def weights(self):
        return self.codes, self.scales, self.minimums

    def dense(self):
        """The weights the layer multiplies by, [out, in] float64 (for tests and benchmarks)."""
        packed = self.codes.reshape(*self.codes.shape[:2], 4, BLOCK, 4)
        codes = from_lanes(torch.cat([packed & 15, packed >> 4], 2)).double()
        scales, minimums = (t.permute(0, 2, 1).reshape(len(codes), -1, 1).double() for t in (self.scales, self.minimums))
        return (codes.reshape(scales.shape[0], -1, INT4_GROUP) * scales + minimums).reshape(codes.shape)

    @staticmethod
    def mm(x, codes, scales, minimums):
        return torch.ops.tokstream.int4_linear(x, codes, scales, minimums)


def linear(weight, fmt, bias=None):
    """weight: [out, in] in the model's dtype -> a Linear in `fmt`."""
    int8 = OwnInt8 if OwnInt8.fits(weight) else Int8
    if fmt == "int8":
        layer = int8(weight)
    elif fmt == "int4":
        int4 = OwnInt4 if OwnInt4.fits(weight) else Int4 if Int4.fits(weight) else None
        layer = int4 and int4(weight)
        if layer is None or layer.error > INT4_MAX_ERROR:  # a shape the kernel cannot take, or too coarse
            layer = int8(weight)
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


def own(tensor, share):
    """The model's tensor itself, or (in another format) a copy of its own: the model's file
    stays mapped while any tensor reads it, and drop_model_matrices frees the rest."""
    if tensor is None:
        return None
    return tensor.detach() if share else tensor.detach().clone()


class Layer:
    def __init__(self, block, fmt):
        attn, mlp = block.self_attn, block.mlp
        share = fmt == str(attn.q_proj.weight.dtype).removeprefix("torch.")
        self.input_norm = own(block.input_layernorm.weight, share)
        self.post_norm = own(block.post_attention_layernorm.weight, share)
        weight, bias = fused([attn.q_proj, attn.k_proj, attn.v_proj], share)
        self.qkv = linear(weight, fmt, bias)
        self.o = linear(attn.o_proj.weight.detach(), fmt, own(attn.o_proj.bias, share))
        self.gate_up = linear(fused([mlp.gate_proj, mlp.up_proj], share)[0], fmt)
        self.down = linear(mlp.down_proj.weight.detach(), fmt)

    def linears(self):
        return self.qkv, self.o, self.gate_up, self.down

    def tensors(self):
        """Every tensor of the layer in one order: the norms', then each linear's."""
        return self.input_norm, self.post_norm, *(t for linear in self.linears() for t in linear.tensors())

    def signature(self):
        return tuple(linear.signature() for linear in self.linears())


class LlamaWeights:
    """The model's weights laid out for decoding, in one format."""

    def __init__(self, model, fmt):
        body, config = model.model, model.config
        self.format = fmt
        self.eps = config.rms_norm_eps
        share = fmt == str(model.dtype).removeprefix("torch.")
        self.embed = own(body.embed_tokens.weight, share)
        self.norm = own(body.norm.weight, share)
        self.layers = [Layer(block, fmt) for block in body.layers]
        self.lm_head = linear(model.lm_head.weight.detach(), fmt)

    @classmethod
    def of(cls, model, fmt):
        """Built once per model and format: engines over the same model share them."""
        built = model.__dict__.setdefault("_tokstream_weights", {})
        if fmt not in built:
            built[fmt] = cls(model, fmt)
        return built[fmt]

    def linears(self):
        return [m for layer in self.layers for m in layer.linears()] + [self.lm_head]


def drop_model_matrices(model, weights):
    """Free the transformers model's own tensors once `weights` hold everything they need in
    another format: a worker never runs the model itself, and in float32 they are most of its
    memory. The model then serves only its config and rotary embedding."""
    if weights.format == str(model.dtype).removeprefix("torch."):
        return  # the weights are views of the model's own tensors
    for parameter in model.parameters():
        parameter.data = parameter.data.new_empty(0)


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

    Every token goes through the same weights in one format and the same kernels, whether it
    is a prompt token in a chunk of hundreds, a decode beside 31 others, or a draft to verify:
    a position's logits, and the keys and values it leaves in the cache (which the prefix
    cache may hand to another request), never depend on what it travelled with."""

    verifies_drafts = True  # gives logits after every token of a chunk that asks

    def __init__(self, model, pool, device, context_length, fmt="float32"):
        config = model.config
        self.pool = pool
        self.device = device
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.attention = PagedAttention(pool, self.kv_heads, self.head_dim, device)
        self.weights = LlamaWeights.of(model, fmt)
        self.cos, self.sin = rotary_table(model, context_length, device)
        self.compiled = None  # the compiled step (compiled.py), once started

    @torch.inference_mode()
    def forward(self, chunks):
        """-> logits [rows, V]: for each chunk the row after its last token, or after each of
        its tokens for a chunk that asks for all of them (a speculative draft to verify)."""
        if self.compiled is not None:
            return self.compiled(chunks)
        w, plan = self.weights, AttentionPlan(chunks, self.pool.block_size, self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)  # [N]
        positions = torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in chunks]).to(self.device)
        x = F.embedding(ids, w.embed)  # [N, hidden]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [N, 1, D]
        sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        n = len(ids)
        for index, layer in enumerate(w.layers):
            q, k, v = layer.qkv(rms_norm(x, layer.input_norm, w.eps)).split(sizes, dim=-1)
            q = rotate(q.view(n, self.heads, self.head_dim), cos, sin)
            k = rotate(k.view(n, self.kv_heads, self.head_dim), cos, sin)
            self.pool.k[index].index_copy_(0, plan.slots, k.to(self.pool.dtype))
            self.pool.v[index].index_copy_(0, plan.slots, v.view(n, self.kv_heads, self.head_dim).to(self.pool.dtype))
            x = x + layer.o(self.attention(index, q, plan))
            gate, up = layer.gate_up(rms_norm(x, layer.post_norm, w.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return w.lm_head(rms_norm(x[plan.logit_rows], w.norm, w.eps))
