"""The engine's forward with its per-layer math under torch.compile, against the eager one.

    .venv/bin/python bench/compiled.py [--format int4] [--steps 16]

Each layer's norms, projections, rotary, residuals and MLP are two compiled functions (before
and after the paged attention, which stays eager: its groups change with every step), and the
final norm and output head a third; `dynamic=True` and the layers passed as arguments, so all 30
layers share a few graphs. Prints the compile's warm-up, decode step times at 1 and 32
sequences with eager and compiled steps alternating in one engine (so noise falls on both), and
how far the compiled logits are from the eager ones on the same steps.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.worker.engine import Engine, Request, SamplingParams, llama, loader  # noqa: E402
from inference.worker.engine.runner import AttentionPlan  # noqa: E402

MODEL = "smollm2-135m-instruct"
NO_STOP = {0: -1e9, 1: -1e9, 2: -1e9}


def before(layer, x, cos, sin, eps, shape):
    heads, kv_heads, head_dim = shape
    n = x.shape[0]
    q, k, v = layer.qkv(llama.rms_norm(x, layer.input_norm, eps)).split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q = llama.rotate(q.view(n, heads, head_dim), cos, sin)
    k = llama.rotate(k.view(n, kv_heads, head_dim), cos, sin)
    return q, k, v.view(n, kv_heads, head_dim)


def after(layer, x, attended, eps):
    x = x + layer.o(attended)
    gate, up = layer.gate_up(llama.rms_norm(x, layer.post_norm, eps)).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up)


def head(weights, x):
    return weights.lm_head(llama.rms_norm(x, weights.norm, weights.eps))


EAGER = (before, after, head)
COMPILED = tuple(torch.compile(f, dynamic=True) for f in EAGER)


def forward(runner, parts):
    """LlamaRunner.forward with its math in `parts`."""
    first, second, last = parts

    @torch.inference_mode()
    def run(chunks):
        w, plan = runner.weights, AttentionPlan(chunks, runner.pool.block_size, runner.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids])
        positions = torch.cat([torch.arange(c.start, c.start + len(c.token_ids)) for c in chunks])
        x = F.embedding(ids, w.embed)
        cos, sin = runner.cos[positions][:, None], runner.sin[positions][:, None]
        for index, layer in enumerate(w.layers):
            q, k, v = first(layer, x, cos, sin, w.eps, (runner.heads, runner.kv_heads, runner.head_dim))
            runner.pool.k[index].index_copy_(0, plan.slots, k.to(runner.pool.k.dtype))
            runner.pool.v[index].index_copy_(0, plan.slots, v.to(runner.pool.v.dtype))
            x = second(layer, x, runner.attention(index, q, plan), w.eps)
        return last(w, x[plan.logit_rows])

    return run


def decoding_engine(lm, fmt, size):
    prompts = [
        lm.tokenizer.apply_chat_template([{"role": "user", "content": f"Write about topic {i}. " * (1 + i % 7)}], add_generation_prompt=True)
        for i in range(size)
    ]
    engine = Engine.for_model(lm, 48_000, max_running=size, weights=fmt)
    params = SamplingParams(max_tokens=4096, temperature=0, logit_bias=NO_STOP, speculative=False)
    engine.add(*[Request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    while engine.load()[1] or any(r.first_token_at is None for r in engine.scheduler.running):
        engine.step()
    return engine


def alternate(engine, steps):
    """Steps alternating eager and compiled; on each, both forwards see the same chunks (the
    compiled one's keys and values stay in the cache), and the eager logits go on."""
    eager, compiled = forward(engine.runner, EAGER), forward(engine.runner, COMPILED)
    times, diffs, agree = {"eager": [], "compiled": []}, [], []

    def both(chunks):
        reference, result = eager(chunks), compiled(chunks)
        diffs.append(float((reference - result).abs().max()))
        agree.append(bool((reference.argmax(-1) == result.argmax(-1)).all()))
        return reference

    for step in range(steps):
        label = "compiled" if step % 2 else "eager"
        engine.runner.forward = compiled if step % 2 else eager
        start = time.perf_counter()
        engine.step()
        times[label].append(time.perf_counter() - start)
    engine.runner.forward = both
    for _ in range(4):
        engine.step()
    return {k: statistics.median(v) * 1000 for k, v in times.items()}, max(diffs), all(agree)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="int4")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    lm = loader.load(MODEL, ROOT / ".cache" / "models" / MODEL, "cpu")
    start = time.perf_counter()
    for size in (1, 3):  # the first compile, then the one for dynamic shapes
        engine = decoding_engine(lm, args.format, size)
        engine.runner.forward = forward(engine.runner, COMPILED)
        engine.step()
    print(f"compile warm-up: {time.perf_counter() - start:.1f} s ({args.format})")
    for size in (1, 32):
        ms, diff, agree = alternate(decoding_engine(lm, args.format, size), args.steps)
        print(
            f"{size:2d} sequences: eager {ms['eager']:6.1f} ms/step, compiled {ms['compiled']:6.1f} ms/step: x{ms['eager'] / ms['compiled']:.2f}; logits max |diff| {diff:.2e}, argmax {'the same' if agree else 'differs'}"
        )


if __name__ == "__main__":
    main()
