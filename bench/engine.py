"""Engine throughput against plain transformers, in one process so the figures compare.

    .venv/bin/python bench/engine.py [--tokens 64] [--quick] [--burst] [--eager] [--format int4]

(a) transformers `generate`, requests one after another;
(b) the bare batched forward loop (transformers, DynamicCache, equal prompts) at batch 1, 8, 32:
    the ceiling for this model on this machine;
(c) the engine with 1, 8 and 32 concurrent requests of mixed prompt lengths, in the weight
    format it measured fastest at load, eager and compiled (the other runs use the compiled
    engine, as the worker ships it; --eager for them all eager).
Prints tokens/s for each and the ratios to (a) and (b); 32 requests arriving at once beside 4
running streams (times to first token, the running streams' worst gap against their step
before and the plain step of all of them after); one stream with prompt-lookup drafts and without; the
time to first token of a request that joins a busy batch (against its own prefill plus two
decode steps); and peak memory (resident set) with 32 running sequences of 2,000 tokens.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.worker.engine import (  # noqa: E402
    Engine,
    Request,
    SamplingParams,
    loader,
)

MODEL = "smollm2-135m-instruct"
STEP_TOKENS = int(os.environ.get("TOKSTREAM_STEP_TOKENS", "24"))
TOPICS = ["tea", "the sea", "volcanoes", "chess", "bread", "owls", "trains", "glass", "rivers", "clocks", "maps"]
# Keep generating for the whole budget, so every run decodes the same number of tokens.
NO_STOP = {0: -1e9, 1: -1e9, 2: -1e9}


def prompts(tokenizer, count):
    """Chat prompts of mixed lengths (about 30 to 300 tokens)."""
    out = []
    for i in range(count):
        detail = " Mention " + ", ".join(TOPICS[: 1 + i % len(TOPICS)]) + "." * (1 + (i * 7) % 5)
        text = f"Write about {TOPICS[i % len(TOPICS)]}." + detail * (1 + (i * 5) % 9)
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return out


# As the worker ships (TOKSTREAM_COMPILE, TOKSTREAM_WEIGHTS); --eager and --format change them for every run.
SHIPPED = {"compile": True, "weights": "auto"}


def make_engine(lm, max_running, cache_tokens=48_000, weights=None, compile=None):
    formats_file = ROOT / ".cache" / "weights" / f"{MODEL}-{str(lm.device).replace(':', '-')}.json"  # the worker's (make model)
    compile = SHIPPED["compile"] if compile is None else compile
    weights = weights or SHIPPED["weights"]
    options = dict(max_running=max_running, step_tokens=STEP_TOKENS, weights=weights, formats_file=formats_file)
    return Engine.for_model(lm, cache_tokens, compile=compile, compile_cache=ROOT / ".cache" / "compiled", **options)


def hf_sequential(lm, batch, tokens):
    start = time.perf_counter()
    for prompt in batch:
        ids = torch.tensor([prompt], device=lm.device)
        lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=2)
    return len(batch) * tokens / (time.perf_counter() - start)


@torch.inference_mode()
def bare_loop(lm, size, tokens, prompt_len):
    """Decode `tokens` steps for `size` equal sequences with transformers' own cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.full((size, prompt_len), 100, device=lm.device)
    logits = lm.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
    start = time.perf_counter()
    for _ in range(tokens):
        next_ids = logits.argmax(-1, keepdim=True)
        logits = lm.model(input_ids=next_ids, past_key_values=cache, use_cache=True).logits[:, -1]
    return size * tokens / (time.perf_counter() - start)


def run(engine):
    while engine.has_work():
        engine.step()


def start_all(lm, batch, max_tokens, weights=None, speculative=True, compile=None):
    engine = make_engine(lm, max_running=len(batch) + 1, weights=weights, compile=compile)  # room for one more to join
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=NO_STOP, speculative=speculative)
    requests = [Request(f"r{n}", p, params) for n, p in enumerate(batch)]
    for request in requests:
        engine.add(request)
    return engine, requests


def engine_throughput(lm, batch, tokens, **options):
    """Tokens/s from arrival to the last token, prefill included."""
    engine, requests = start_all(lm, batch, tokens, **options)
    start = time.perf_counter()
    run(engine)
    return sum(len(r.output_ids) for r in requests) / (time.perf_counter() - start)


def engine_decoding(lm, batch, steps, **options):
    """Tokens/s of steps in which every request decodes: the figure to hold against (b); and
    the mean context length then, for (b) to decode at."""
    engine, requests = start_all(lm, batch, 1024, **options)
    while engine.load()[1] or any(r.first_token_at is None for r in requests):
        engine.step()
    context = statistics.mean(len(r.all_ids) for r in requests) + steps / 2
    before = sum(len(r.output_ids) for r in requests)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    produced = sum(len(r.output_ids) for r in requests) - before
    return produced / (time.perf_counter() - start), round(context - steps / 2)


def speculation_ab(lm, tokens):
    """One greedy stream, drafts on and off, alternated: a reply that copies its prompt and one
    that does not."""
    copy = "Add type hints to this function and change nothing else:\n\ndef mean(values, weights):\n    total = sum(v * w for v, w in zip(values, weights))\n    return total / sum(weights)\n"
    for label, text in (("copying reply", copy), ("free reply", "Tell me about the history of tea.")):
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        runs = {False: [], True: []}
        for _ in range(2):
            for speculative in runs:
                engine, requests = start_all(lm, [prompt], tokens, speculative=speculative)
                start = time.perf_counter()
                run(engine)
                runs[speculative].append(len(requests[0].output_ids) / (time.perf_counter() - start))
        kept, drafted = engine.stats["draft_tokens_kept"], engine.stats["draft_tokens"]
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"one stream, {label}: drafts off {off:6.1f} tok/s, on {on:6.1f} tok/s: x{on / off:.2f}; {kept} of {drafted} draft tokens kept")


def burst(lm, tokens, running=4, arrivals=32):
    """`arrivals` chat requests arriving at once beside `running` decoding streams: their times
    to first token; the running streams' worst gap while the prompts are computed, against
    their usual one before and against the plain step of every stream after (the newcomers
    decoding beside them: the gap all of them keep from then on)."""
    questions = [f"Write a short note about {TOPICS[i % len(TOPICS)]} number {i}." for i in range(arrivals + running)]
    chats = [lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    engine = make_engine(lm, max_running=arrivals + running, cache_tokens=(arrivals + running) * 512)
    params = SamplingParams(max_tokens=tokens, temperature=0, logit_bias=NO_STOP, speculative=False)
    streams = [Request(f"s{n}", p, replace(params, max_tokens=4 * tokens)) for n, p in enumerate(chats[:running])]  # outlasting the burst
    engine.add(*streams)
    while any(r.first_token_at is None for r in streams):
        engine.step()
    before = statistics.median(timed_steps(engine, 8))
    newcomers = [Request(f"b{n}", p, params) for n, p in enumerate(chats[running:])]
    engine.add(*newcomers)
    gaps = []
    while any(r.first_token_at is None for r in newcomers):
        gaps += timed_steps(engine, 1)
    after = statistics.median(timed_steps(engine, 8))
    ttfts = sorted(r.first_token_at - r.arrived_at for r in newcomers)
    return ttfts[len(ttfts) // 2], ttfts[int(len(ttfts) * 0.95)], max(gaps) / before, max(gaps) / after


def burst_report(lm, tokens, runs=2):
    results = [burst(lm, tokens) for _ in range(runs)]
    p50, p95, over_before, over_after = (statistics.median(r[i] for r in results) for i in range(4))
    print(
        f"32 arriving beside 4 streams: TTFT p50 {p50 * 1000:5.0f} ms, p95 {p95 * 1000:5.0f} ms; "
        f"running streams' worst gap x{over_before:.2f} of their step before, x{over_after:.2f} of the plain step after (medians of {runs})"
    )


def join_busy_batch(lm, batch, tokens):
    """TTFT of a request joining 31 decoding ones, against its own prefill + 2 decode steps."""
    engine = make_engine(lm, max_running=len(batch) + 1)
    for n, prompt in enumerate(batch):
        engine.add(Request(f"r{n}", prompt, SamplingParams(max_tokens=tokens, temperature=0, logit_bias=NO_STOP)))
    while engine.load()[1] or any(r.first_token_at is None for r in engine.scheduler.running):
        engine.step()  # every one of them decoding
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    newcomer = Request("new", batch[0], SamplingParams(max_tokens=2, temperature=0))
    start = time.perf_counter()
    engine.add(newcomer)
    while newcomer.first_token_at is None:
        engine.step()
    ttft = time.perf_counter() - start
    alone = make_engine(lm, max_running=1)
    alone.add(Request("alone", batch[0], SamplingParams(max_tokens=1, temperature=0)))
    start = time.perf_counter()
    run(alone)
    prefill = time.perf_counter() - start
    return ttft, prefill, statistics.median(steps)


def gap_during_long_prefill(lm, batch, prompt_tokens=4000):
    """Inter-token gap of 8 decoding streams before and while a 4,000-token prompt prefills."""
    engine, requests = start_all(lm, batch[:8], 2_000)
    while engine.load()[1] or any(r.first_token_at is None for r in requests):
        engine.step()
    usual = timed_steps(engine, 8)
    long = Request("long", [100] * prompt_tokens, SamplingParams(max_tokens=1, temperature=0))
    engine.add(long)
    during = []
    while long.first_token_at is None:
        during += timed_steps(engine, 1)
    return statistics.median(usual), statistics.median(during), max(during), len(during)


def timed_steps(engine, count):
    times = []
    for _ in range(count):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def memory_with_long_sequences(lm, count=32, length=2000):
    engine = make_engine(lm, max_running=count, cache_tokens=count * (length + 64))
    prompt = [100] * (length - 8)
    for n in range(count):
        engine.add(Request(f"m{n}", prompt, SamplingParams(max_tokens=8, temperature=0, logit_bias=NO_STOP)))
    run(engine)
    kv_bytes = engine.pool.nbytes()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, kv_bytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="skip (a) and the memory run")
    parser.add_argument("--memory", action="store_true", help="only the memory run")
    parser.add_argument("--eager", action="store_true", help="every engine eager, not only the (c) table's first column")
    parser.add_argument("--burst", action="store_true", help="only the 32 arriving beside 4 streams")
    parser.add_argument("--format", default="auto", help="the weight format of every engine (auto: as measured and kept)")
    args = parser.parse_args()
    SHIPPED.update(compile=not args.eager, weights=args.format)
    if args.memory:
        return report_memory()
    lm = loader.load(MODEL, ROOT / ".cache" / "models" / MODEL, loader.pick_devices()[0])
    if args.burst:
        return burst_report(lm, args.tokens)
    print(f"torch threads {torch.get_num_threads()}, device {lm.device}, {args.tokens} tokens per request")
    batch32 = prompts(lm.tokenizer, 32)
    bare_loop(lm, 1, 4, 16)  # warm up
    engine_throughput(lm, batch32[:2], 4)
    sequential = None if args.quick else hf_sequential(lm, batch32[:8], args.tokens)
    if sequential:
        print(f"(a) generate, one request after another (prefill included): {sequential:7.1f} tok/s")
    weights = make_engine(lm, 1).runner.weights
    print(f"weights: {weights.format} for every token" + (" (as `auto` measured and kept for this machine)" if args.format == "auto" else ""))
    for size in (1, 8, 32):
        eager, context = engine_decoding(lm, batch32[:size], args.tokens, speculative=False, compile=False)
        decoding, _ = engine_decoding(lm, batch32[:size], args.tokens, speculative=False, compile=True)
        bare = bare_loop(lm, size, args.tokens, context)  # the ceiling, at the engine's mean context
        whole = engine_throughput(lm, batch32[:size], args.tokens)
        vs_a = f"   whole/(a) x{whole / sequential:5.2f}" if sequential else ""
        print(
            f"batch {size:2d}: (b) bare decode {bare:6.1f} tok/s | (c) engine decoding, {weights.format} eager {eager:6.1f}, compiled {decoding:6.1f} tok/s, "
            f"x{eager / bare:4.2f} / x{decoding / bare:4.2f} of (b) | engine with prefill {whole:6.1f} tok/s{vs_a}"
        )
    burst_report(lm, args.tokens)
    speculation_ab(lm, args.tokens)
    ttft, prefill, step = join_busy_batch(lm, batch32[:31], args.tokens)
    print(
        f"joining 31 busy requests: TTFT {ttft * 1000:.0f} ms; own prefill alone {prefill * 1000:.0f} ms + 2 steps of {step * 1000:.0f} ms = {(prefill + 2 * step) * 1000:.0f} ms"
    )
    usual, during, worst, steps = gap_during_long_prefill(lm, batch32)
    print(
        f"8 streams while a 4,000-token prompt prefills ({steps} steps): gap {during * 1000:.0f} ms median, "
        f"{worst * 1000:.0f} ms worst, against {usual * 1000:.0f} ms before: x{during / usual:.2f} (worst x{worst / usual:.2f})"
    )
    if not args.quick:  # in a process of its own: peak memory is per process
        subprocess.run([sys.executable, __file__, "--memory"], check=True)


def report_memory():
    lm = loader.load(MODEL, ROOT / ".cache" / "models" / MODEL, loader.pick_devices()[0])
    model_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    peak, kv = memory_with_long_sequences(lm)
    budget = model_bytes + kv + 500 * 2**20
    print(
        f"32 x 2,000 tokens: peak RSS {peak / 2**20:.0f} MB against model {model_bytes / 2**20:.0f} MB + KV {kv / 2**20:.0f} MB + 500 MB = {budget / 2**20:.0f} MB"
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
