"""The worker's resident memory on its shipped defaults, and what the KV cache's dtype costs.

    .venv/bin/python bench/memory.py [--streams 32] [--tokens 256] [--tree DIR] [--sampled] [--quality]

(a) In a fresh process per figure: loads the default model as the worker does (engines.load and
    engines.build_engine, with the shipped settings), then runs `streams` greedy requests at once
    for `tokens` tokens each, and prints the peak resident set (VmHWM) and the resident set
    (VmRSS) after the start and after the streams; and the tokens per second of one stream,
    then of `streams` together (prefill included): greedy, or with `--sampled` each with its
    own seed at temperature 0.8 and top-p 0.95. `--tree` runs the worker code of another
    checkout (an older commit in a git worktree) first, so before and after come from one
    command; each tree keeps its measured weight format in its own data directory.
(b) With `--quality`: the evaluation text teacher-forced through each weight format with its KV
    cache in float32 and in bfloat16: perplexity, and top-1 agreement with float32 weights and
    a float32 cache.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["tea", "the sea", "volcanoes", "chess", "bread", "owls", "trains", "glass"]


def status_mb(field):
    """VmHWM: the peak resident set so far; VmRSS: the resident set now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    return None


def worker_figures(streams, tokens, sampled=False):
    """Runs inside the child: the worker's engine on the shipped settings."""
    import django

    django.setup()
    from django.conf import settings

    try:
        from inference.worker import engines
    except ImportError:  # a tree from before worker/loops.py was split
        from inference.worker import loops as engines

    name = next(n for n, entry in settings.TOKSTREAM_MODELS.items() if entry["source"].startswith("package:"))  # the shipped model
    engine = engines.build_engine(engines.load(name))
    started = {"resident after the start MB": status_mb("VmRSS"), "peak during the start MB": status_mb("VmHWM")}
    one = tokens_per_second(engine, 1, tokens, sampled)
    many = tokens_per_second(engine, streams, tokens, sampled)
    pool = engine.pool
    if isinstance(pool.k, list):  # one tensor per layer
        cache_mb, kv_dtype = pool.nbytes() // 2**20, pool.dtype
    else:  # a tree from before the compiled step: one tensor for every layer
        cache_mb, kv_dtype = (pool.k.numel() + pool.v.numel()) * pool.k.element_size() // 2**20, pool.k.dtype
    return {
        **started,
        "resident after the streams MB": status_mb("VmRSS"),
        "peak MB": status_mb("VmHWM"),
        "KV cache MB": cache_mb,
        "KV dtype": str(kv_dtype),
        "preemptions": engine.stats["preemptions"],
        "tokens/s, 1 stream": round(one, 1),
        f"tokens/s, {streams} streams": round(many, 1),
    }


def tokens_per_second(engine, streams, tokens, sampled):
    """Streams of `tokens` tokens each, started together: their tokens over the time. The bias
    keeps the special tokens (the end of a reply among them) from being chosen."""
    from inference.worker.engine import Request, SamplingParams

    for i in range(streams):
        text = f"Write a long essay about {TOPICS[i % len(TOPICS)]}." + " Be thorough." * (i % 7)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        knobs = dict(temperature=0.8, top_p=0.95, seed=i) if sampled else dict(temperature=0)
        engine.add(Request(f"{streams}-{i}", prompt, SamplingParams(max_tokens=tokens, logit_bias={0: -1e9, 1: -1e9, 2: -1e9}, **knobs)))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return streams * tokens / (time.perf_counter() - start)


def measure_tree(tree, streams, tokens, sampled):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tokstream_site.settings",
        "TOKSTREAM_CACHE_DIR": str(tree / ".cache"),
        "TOKSTREAM_MODEL_CACHE": str(ROOT / ".cache" / "models"),
    }
    code = f"import sys, json; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT / 'bench')!r}); import memory; print(json.dumps(memory.worker_figures({streams}, {tokens}, {sampled})))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def quality():
    sys.path.insert(0, str(ROOT))
    import torch

    from inference.worker.engine import formats, loader

    lm = loader.load("smollm2-135m-instruct", ROOT / ".cache" / "models" / "smollm2-135m-instruct", torch.device("cpu"), "float32")
    reference = None
    for fmt in ("float32", "bfloat16", "int4"):
        for kv in ("float32", "bfloat16"):
            logits, targets = formats.teacher_forced(lm.model, lm.tokenizer, lm.device, fmt, kv)
            picks = logits.argmax(-1)
            reference = picks if reference is None else reference
            perplexity = float(torch.exp(torch.nn.functional.cross_entropy(logits, targets)))
            print(f"weights {fmt:9} KV {kv:9} perplexity {perplexity:.4f}  top-1 vs float32 {float((picks == reference).float().mean()):.4f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tree", action="append", default=[], help="another checkout to measure first (repeatable)")
    parser.add_argument("--sampled", action="store_true", help="seeded streams at temperature 0.8, top-p 0.95")
    parser.add_argument("--quality", action="store_true")
    args = parser.parse_args()
    for tree in [*args.tree, str(ROOT)]:
        print(tree if tree != str(ROOT) else "this tree", measure_tree(Path(tree), args.streams, args.tokens, args.sampled), flush=True)
    if args.quality:
        quality()


if __name__ == "__main__":
    main()
