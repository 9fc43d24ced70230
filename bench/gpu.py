"""The engine alone on a GPU: greedy equality with `generate`, then throughput against it.

    bench/gpu.sh            (on a machine with a CUDA GPU, Python, torch and transformers)
    bench/gpu.sh --cpu      (the same at a smoke size on the CPU, in under a minute: CI runs it,
                             so the script and its report are known to work before a GPU run)

Needs no Django, Celery or Redis, and no weights: the models are random-initialised from the
shipped model's config (SmolLM2-135M) and from a Llama config of about 1B parameters; the
figures do not depend on the values. The text is never shown, so token ids stand in for a
tokenizer. Prints, per model: whether greedy decoding equals `generate` (float32), eager and
compiled; then tokens per second at 1, 32, 128 and 256 concurrent sequences for the engine
(bfloat16 on CUDA), eager and compiled (compiled.py: CUDA graphs, one per bucket of sizes),
sequential `generate`, and the bare batched loop of transformers, and peak GPU memory. The CPU
mode pads its compiled steps to the same buckets, so the bucket code runs before a GPU does.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.worker.engine import Engine, Request, SamplingParams, compiled  # noqa: E402
from inference.worker.engine.loader import LoadedModel  # noqa: E402

SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
    vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
)  # fmt: skip


class Ids:
    """A stand-in tokenizer: the engine's detokenizer sees each id as a word."""

    def decode(self, ids, **_):
        return "".join(f" {i}" for i in ids)

    def encode(self, text, **_):
        return [int(word) for word in text.split()]


def build(shape, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    return LoadedModel("random", model, Ids(), torch.device(device), frozenset(), config.max_position_embeddings, "ids")


def prompts(count, vocab, generator):
    lengths = torch.randint(32, 128, (count,), generator=generator)
    return [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_of(lm, cache_tokens, compile, **options):
    """The engine, eager or compiled; compiled steps padded to CUDA graphs' buckets on any device."""
    engine = Engine.for_model(lm, cache_tokens, **options)
    if compile:
        start = time.perf_counter()
        engine.runner.compiled = compiled.start(engine.runner, bucketed=True)
        if engine.runner.compiled is None:
            raise RuntimeError("the compiled step failed: see the log line above")
        print(f"  compiled step ready in {time.perf_counter() - start:.1f} s", flush=True)
    return engine


def greedy_outputs(lm, batch, tokens, compile):
    engine = engine_of(lm, 16384, compile, weights="float32")
    requests = [Request(str(n), p, SamplingParams(max_tokens=tokens, temperature=0, speculative=False)) for n, p in enumerate(batch)]
    engine.add(*requests)
    while engine.has_work():
        engine.step()
    return [request.output_ids for request in requests]


def greedy_equal(lm, batch, tokens):
    """(How many of `batch` prompts the eager engine decodes to exactly what `generate` gives,
    how many the compiled engine decodes to what the eager one gives)."""
    eager = greedy_outputs(lm, batch, tokens, compile=False)
    same = 0
    for prompt, output in zip(batch, eager):
        ids = torch.tensor([prompt], device=lm.device)
        reference = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        same += output == reference[0, ids.shape[1] :].tolist()
    return same, sum(a == b for a, b in zip(greedy_outputs(lm, batch, tokens, compile=True), eager))


def engine_rate(lm, batch, tokens, compile):
    """Tokens/s over steps in which every sequence decodes (prefill excluded, as for the loops)."""
    own = str(lm.model.dtype).removeprefix("torch.")  # what `auto` takes on CUDA; on the CPU, no measuring
    engine = engine_of(lm, len(batch) * (128 + tokens + 32), compile, max_running=len(batch), weights=own)
    params = SamplingParams(max_tokens=tokens + 8, temperature=0, speculative=False)
    requests = [Request(str(n), p, params) for n, p in enumerate(batch)]
    engine.add(*requests)
    while any(r.first_token_at is None for r in requests):
        engine.step()
    before = sum(len(r.output_ids) for r in requests)
    sync(lm.device)
    start = time.perf_counter()
    for _ in range(tokens):
        engine.step()
    sync(lm.device)
    return (sum(len(r.output_ids) for r in requests) - before) / (time.perf_counter() - start)


def generate_rate(lm, batch, tokens):
    start = time.perf_counter()
    for prompt in batch:
        ids = torch.tensor([prompt], device=lm.device)
        lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    sync(lm.device)
    return len(batch) * tokens / (time.perf_counter() - start)


@torch.inference_mode()
def bare_rate(lm, size, tokens, prompt_len=80):
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.full((size, prompt_len), 5, device=lm.device)
    logits = lm.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
    sync(lm.device)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = lm.model(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True).logits[:, -1]
    sync(lm.device)
    return size * tokens / (time.perf_counter() - start)


def report(name, shape, device, sizes, tokens):
    generator = torch.Generator().manual_seed(1)
    exact = build(shape, device, torch.float32)
    batch = prompts(4, shape["vocab_size"], generator)
    eager, compiled_ = greedy_equal(exact, batch, 32)
    print(f"{name}: greedy (float32) equals generate for {eager} of {len(batch)} prompts; compiled equals eager for {compiled_} of {len(batch)}", flush=True)
    del exact
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lm = build(shape, device, dtype)
    sequential = statistics.median(generate_rate(lm, prompts(1, shape["vocab_size"], generator), tokens) for _ in range(2))
    print(f"{name} ({str(dtype).removeprefix('torch.')}): generate, one request: {sequential:8.1f} tok/s", flush=True)
    for size in sizes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        batch = prompts(size, shape["vocab_size"], generator)
        rates = {compile: engine_rate(lm, batch, tokens, compile) for compile in (False, True)}
        peak = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
        bare = bare_rate(lm, size, tokens)
        ratios = {
            compile: f"{rate:8.1f} tok/s = x{rate / sequential:6.2f} of generate, x{rate / bare:4.2f} of the bare loop" for compile, rate in rates.items()
        }
        print(f"{name} batch {size:3d}: engine {ratios[False]}; compiled {ratios[True]} (bare loop {bare:8.1f} tok/s){peak}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="a small run on the CPU, to check the script")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the equality check
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    sizes = (1, 4) if device.type == "cpu" else (1, 32, 128, 256)
    report("SmolLM2-135M shape", SMOLLM2, device, sizes, args.tokens if device.type == "cuda" else 8)
    if device.type == "cuda":
        report("Llama 1B shape", LLAMA_1B, device, sizes, args.tokens)


if __name__ == "__main__":
    main()
