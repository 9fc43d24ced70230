"""The engine's forward pass as one compiled program (torch.compile), for every step.

Eager, a step is some 400 small operations dispatched one by one from Python; at one sequence
that costs more than the matrix products. Compiled, inductor fuses each layer's norms, rotary
embedding, residuals, cache writes and attention into a few C++ loops (Triton kernels on a GPU),
and the matrix products stay the weight format's own kernels (llama.py).

One program serves every step, whatever it carries: decodes, pieces of prompts, drafts to
verify. Each token is a row with its own position and its own sequence's block table, and
its attention reads that row's keys alone: on the CPU through a C++ operator
(paged_attention.cpp, cpu_ops.py), elsewhere as a gather and two sums that inductor writes as kernels. A
row's result depends on that row alone: not on how many rows travel with it, nor on how far
the widest table is padded (tests/test_invariance.py, tests/test_paged_attention.py). So a reply does not depend
on what else ran beside it, and a token's keys and values come out the same whether they were
computed in a prompt, after a preemption, or in a decode step (the one numeric path of
issue 21).

The number of tokens (N), the width of the widest table in blocks (W) and the number of logit
rows (R) are dynamic sizes: one compile serves every step. On CUDA, whose graphs need fixed
sizes, they are padded to powers of two, a graph per bucket. The 30 layers share one compiled
region, so the first compile costs one layer's (about 30 s on these CPUs) and later starts read
it from the compile cache. The eager path (llama.py) stays for a compile that fails.
"""

import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cpu_ops, llama, precompiled
from .llama import rms_norm, rotate
from .runner import Chunk

log = logging.getLogger(__name__)

MIN_BUCKET = 8  # the smallest padded row count on CUDA
WARM_ROWS = 32  # rows of the step that compiles the program


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    eps: float


@dataclass
class StepInputs:
    ids: torch.Tensor  # [N] every chunk's tokens, in order
    positions: torch.Tensor  # [N] each token's position in its sequence
    slots: torch.Tensor  # [N] the cache slot its keys and values go to
    tables: torch.Tensor  # [N, W] the blocks it reads: its sequence's, padded
    logit_rows: torch.Tensor  # [R] the rows whose logits the step returns

    @classmethod
    def of(cls, chunks, block_size, device, scratch_block, bucketed=False):
        """The step's tensors, built on the host and moved once. With `bucketed`, N, W and R
        are padded to powers of two: padding rows write the scratch block and read block 0."""
        ids, positions, slots, tables, rows = [], [], [], [], []
        width = max(-(-(c.start + len(c.token_ids)) // block_size) for c in chunks)
        width = bucket(width, 1) if bucketed else width
        for chunk in chunks:
            first, count = len(ids), len(chunk.token_ids)
            span = range(chunk.start, chunk.start + count)
            ids += chunk.token_ids
            positions += span
            slots += [chunk.blocks[p // block_size] * block_size + p % block_size for p in span]
            table = chunk.blocks[:width] + [0] * (width - min(width, len(chunk.blocks)))
            tables += [table] * count
            rows += range(first + count - chunk.logit_rows(), first + count)
        if bucketed:
            pad = bucket(len(ids), MIN_BUCKET) - len(ids)
            ids, positions, tables = ids + [0] * pad, positions + [0] * pad, tables + [[0] * width] * pad
            slots += [scratch_block * block_size] * pad
            rows += [0] * (bucket(len(rows), MIN_BUCKET) - len(rows))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)  # noqa: E731
        return cls(as_tensor(ids), as_tensor(positions), as_tensor(slots), as_tensor(tables), as_tensor(rows))

    def tensors(self):
        return self.ids, self.positions, self.slots, self.tables, self.logit_rows


def bucket(size, smallest):
    return max(smallest, 1 << (size - 1).bit_length())


def attend(q, k_cache, v_cache, tables, positions, shape):
    """q: [N, Hq, D]; caches: [slots, Hkv, D]; tables: [N, W]; positions: [N] -> [N, Hq * D].
    Every row against its own keys up to its position; the positions it does not see weigh
    exactly zero, so padding a table changes nothing. On the CPU, the C++ operator of
    paged_attention.cpp; elsewhere, a gather and two sums that inductor writes as kernels."""
    if q.device.type == "cpu":
        return torch.ops.tokstream.paged_attention(q.float(), k_cache, v_cache, tables, positions, shape.block_size)
    return gathered(q, k_cache, v_cache, tables, positions, shape)


def gathered(q, k_cache, v_cache, tables, positions, shape):
    """attend() as a gather of each row's keys and two sums over them."""
    n, size = len(q), shape.block_size
    width = tables.shape[1] * size
    slots = (tables[:, :, None] * size + torch.arange(size, device=q.device)).reshape(n, width)  # [N, C]
    keys = k_cache[slots].float().permute(0, 2, 1, 3)  # [N, Hkv, C, D]
    values = v_cache[slots].float().permute(0, 2, 1, 3)
    q = q.float().view(n, shape.kv_heads, -1, 1, shape.head_dim)  # [N, Hkv, G, 1, D]
    scores = (q * keys[:, :, None]).sum(-1) * shape.head_dim**-0.5  # [N, Hkv, G, C]
    unseen = torch.arange(width, device=q.device)[None, :] > positions[:, None]  # [N, C]
    weights = torch.softmax(scores.masked_fill(unseen[:, None, None], float("-inf")), dim=-1)
    return (weights[..., None] * values[:, :, None]).sum(3).reshape(n, -1)  # [N, Hq * D]


def layer_step(model, shape):
    """One decoder layer over the step's rows, shared by every layer of the same signature as
    `model` (the same formats): each passes its own tensors. It takes tensors only, and sees
    `model` and `shape` as constants, so its region is traced once, not once per layer."""
    counts = [len(linear.tensors()) for linear in model.linears()]

    @torch.compiler.nested_compile_region
    def step(x, cos, sin, k_cache, v_cache, slots, tables, positions, input_norm, post_norm, *tensors):
        n, dim = len(x), shape.head_dim
        qkv, o, gate_up, down = split(tensors, counts)
        heads = (shape.heads, shape.kv_heads, shape.kv_heads)
        # Heads viewed before the split: a view of one part of the split would have to prove
        # to the compiler that the step has more than one row, or compile for one.
        q, k, v = model.qkv.apply(rms_norm(x, input_norm, shape.eps), *qkv).view(n, sum(heads), dim).split(heads, dim=1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache.index_put_((slots,), k.to(k_cache.dtype))
        v_cache.index_put_((slots,), v.to(v_cache.dtype))
        x = x + model.o.apply(attend(q, k_cache, v_cache, tables, positions, shape).to(x.dtype), *o)
        gate, up = model.gate_up.apply(rms_norm(x, post_norm, shape.eps), *gate_up).chunk(2, dim=-1)
        return x + model.down.apply(F.silu(gate) * up, *down)

    return step


def split(tensors, counts):
    parts, start = [], 0
    for count in counts:
        parts.append(tensors[start : start + count])
        start += count
    return parts


def forward(weights, steps, k_caches, v_caches, cos_table, sin_table, ids, positions, slots, tables, logit_rows):
    """-> logits [R, V]. `steps`: each layer's compiled step (layer_step)."""
    x = F.embedding(ids, weights.embed)  # [N, hidden]
    cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]  # [N, 1, D]
    for layer, step, k_cache, v_cache in zip(weights.layers, steps, k_caches, v_caches):
        x = step(x, cos, sin, k_cache, v_cache, slots, tables, positions, *layer.tensors())
    return weights.lm_head(rms_norm(x[logit_rows], weights.norm, weights.eps))


def use_int4_kernel_as_called():
    """Inductor lowers the CPU int4 product to a variant that takes the group size as a tensor
    constant, which it gets wrong inside a compiled region shared by several layers ("group
    size must be a scalar"); calling the kernel as eager does is as fast."""
    from torch._inductor import lowering

    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    if lowering.lowerings.pop(op.default, None) is not None:
        lowering.make_fallback(op)


# One program per process for every engine on a kind of device: engines of the same model
# structure share it, and a structure or format it has not seen adds an entry to it.
# The wrapper's checks of every buffer's size cost more than half a millisecond a step, and the
# program is only ever given what compiled it.
UNCHECKED = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
PROGRAMS = {
    "cpu": torch.compile(forward, dynamic=False, fullgraph=True, options=UNCHECKED),
    "cuda": torch.compile(forward, dynamic=False, fullgraph=True, mode="reduce-overhead"),
}
_layer_steps = {}  # (layer signature, Shape) -> its compiled region


class CompiledStep:
    """forward(chunks) -> logits, through the compiled program: precompiled and saved where
    torch can (precompiled.py), else traced by torch.compile at each start (and on CUDA, where
    the traced program records its CUDA graphs)."""

    def __init__(self, runner, cache_dir=None, bucketed=None):
        if cache_dir is not None:  # read whenever the compiler looks (it sets a default of its own)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
        use_int4_kernel_as_called()
        # A step the program cannot serve must fail, never run the slow eager form of it.
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        self.runner = runner
        self.cache_dir = cache_dir
        self.device = torch.device(runner.device)
        self.cuda = self.device.type == "cuda"
        if self.device.type == "cpu":
            cpu_ops.load(cache_dir)
        self.bucketed = self.cuda if bucketed is None else bucketed  # CUDA graphs need a few fixed sizes
        self.pool = runner.pool
        self.program = PROGRAMS[self.device.type]
        self.precompiled = None
        self.shape = Shape(runner.heads, runner.kv_heads, runner.head_dim, self.pool.block_size, runner.weights.eps)
        self.steps = [_layer_steps.setdefault((layer.signature(), self.shape), layer_step(layer, self.shape)) for layer in runner.weights.layers]
        for tensor in (*self.pool.k, *self.pool.v, runner.cos, runner.sin):  # any cache size, any context
            torch._dynamo.mark_dynamic(tensor, 0)
        if self.cuda:  # CUDA graphs read these where they are: they must never move
            for tensor in (*self.pool.k, *self.pool.v, *weight_tensors(runner.weights)):
                torch._dynamo.mark_static_address(tensor)

    def __call__(self, chunks):
        inputs = StepInputs.of(chunks, self.pool.block_size, self.device, self.pool.scratch_block, self.bucketed)
        if self.precompiled is not None:
            logits = self.precompiled(*self.arguments(inputs))
        else:
            logits = self.traced(inputs)
        return logits[: sum(c.logit_rows() for c in chunks)] if self.bucketed else logits

    def arguments(self, inputs):
        return (self.runner.weights, self.steps, self.pool.k, self.pool.v, self.runner.cos, self.runner.sin, *inputs.tensors())

    def traced(self, inputs):
        self.mark_sizes(inputs)
        # Sizes of 1 and sizes that happen to be equal are not special: one program for every step.
        with torch.fx.experimental._config.patch(backed_size_oblivious=True, use_duck_shape=False):
            return self.program(*self.arguments(inputs))

    def warm_up(self):
        """Compile now (or load what an earlier start saved), writing only the scratch block,
        then take every shape of step once. The first step's sizes are the compiler's hints: a
        batch's, so that it spreads the loops over the cores (a hint of one row made it run
        some on one)."""
        scratch = [self.pool.scratch_block]
        shapes = ([Chunk([0], 0, scratch)] * WARM_ROWS, [Chunk([0], 0, scratch)], [Chunk([0] * 3, 0, scratch, all_logits=True)])
        with precompiled.plain_pickling(), torch.inference_mode():  # inference mode as every step runs: another would compile again
            if not self.bucketed and precompiled.available(self.program):
                example = StepInputs.of(shapes[0], self.pool.block_size, self.device, self.pool.scratch_block)
                self.mark_sizes(example)
                compile_program = precompiled.compiler(self.program, self.arguments(example))
                self.precompiled = precompiled.program(self.key(), compile_program, self.cache_dir, forward.__globals__)
            for chunks in shapes:
                self(chunks)

    @staticmethod
    def mark_sizes(inputs):
        for tensor in inputs.tensors():
            torch._dynamo.mark_dynamic(tensor, 0)
        torch._dynamo.mark_dynamic(inputs.tables, 1)

    def key(self):
        """Everything the program was compiled for: a saved one serves only where all of it holds."""
        w = self.runner.weights
        parts = [
            torch.__version__,
            self.device.type,
            cpu_ops.cpu_description(),
            *(Path(module.__file__).read_text() for module in (sys.modules[__name__], llama)),
            cpu_ops.key(),
            repr(self.shape),
            repr([layer.signature() for layer in w.layers] + [w.lm_head.signature()]),
            str(self.pool.dtype),
            str(w.embed.dtype),
            repr(sorted(UNCHECKED.items())),
        ]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def start(runner, cache_dir=None, bucketed=None):
    """The runner's compiled step, compiled now; None (the eager step) where compiling fails.
    `bucketed`: pad each step to CUDA graphs' sizes (by default on CUDA only)."""
    try:
        step = CompiledStep(runner, cache_dir, bucketed)
        step.warm_up()
    except Exception as exc:  # a worker that cannot compile still serves, eagerly
        log.warning("the compiled step failed, the engine runs eager: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    return step


def weight_tensors(weights):
    tensors = [weights.embed, weights.norm]
    for layer in weights.layers:
        tensors += layer.tensors()
    return tensors + list(weights.lm_head.tensors())
