"""The compiled step against the eager one, by the shape of a step, in one process.

    .venv/bin/python bench/step_shapes.py [--format int4] [--repeats 3] [--long]

One engine over the shipped model (in the format `auto` chose, or --format), its compiled step
loaded from the data directory or compiled there. Each shape runs eagerly and compiled in turn,
`--repeats` times, so the machine's noise falls on both; the best time of each is printed with
their ratio. Shapes: decode steps of 1 and 32 sequences at 300, 2,000 and 5,000 tokens of
context, and one prompt piece of 24 or 512 tokens at 1,000 and 5,000 (the 512-token piece at
5,000 takes minutes compiled: --long).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import django  # noqa: E402

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")
django.setup()

from django.conf import settings  # noqa: E402

from inference.worker import engines  # noqa: E402
from inference.worker.engine import Engine  # noqa: E402
from inference.worker.engine.runner import Chunk  # noqa: E402

MODEL = "smollm2-135m-instruct"
BLOCK = 16
DECODES = [(1, 300), (1, 2000), (1, 5000), (32, 300), (32, 2000)]
PIECES = [(24, 1000), (24, 5000), (512, 1000)]


def decode_step(sequences, context):
    """One token for each of `sequences` sequences `context` tokens long, each in its own blocks."""
    width = -(-context // BLOCK)
    return [Chunk([100 + k], context - 1, list(range(k * width, (k + 1) * width))) for k in range(sequences)]


def prompt_piece(rows, context):
    """The last `rows` tokens of a prompt `context` tokens long."""
    return [Chunk(list(range(100, 100 + rows)), context - rows, list(range(-(-context // BLOCK))))]


def best_times(runner, chunks, repeats):
    """{mode: best seconds}, eager and compiled taking turns."""
    compiled, times = runner.compiled, {"eager": [], "compiled": []}
    with torch.inference_mode():
        for _ in range(repeats):
            for mode in times:
                runner.compiled = compiled if mode == "compiled" else None
                start = time.perf_counter()
                runner.forward(chunks)
                times[mode].append(time.perf_counter() - start)
    runner.compiled = compiled
    return {mode: min(values) for mode, values in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long", action="store_true", help="also a 512-token prompt piece at 5,000 tokens")
    args = parser.parse_args()
    lm = engines.load(MODEL)
    cache_tokens = max(s * -(-c // BLOCK) * BLOCK for s, c in DECODES) + BLOCK
    engine = Engine.for_model(
        lm, cache_tokens, weights=args.format, formats_file=engines.formats_file(lm), compile=True, compile_cache=settings.CACHE_DIR / "compiled"
    )
    if engine.runner.compiled is None:
        sys.exit("the step did not compile here (the worker's log line says why)")
    print(f"{MODEL}, {engine.runner.weights.format}, {torch.get_num_threads()} threads; best of {args.repeats}, eager and compiled in turns")
    print("| step | eager | compiled | compiled / eager |\n|---|---|---|---|")
    shapes = [(f"decode, {s} x {c} tokens of context", decode_step(s, c)) for s, c in DECODES]
    shapes += [(f"prompt piece of {r} tokens at {c}", prompt_piece(r, c)) for r, c in PIECES + ([(512, 5000)] if args.long else [])]
    for label, chunks in shapes:
        best = best_times(engine.runner, chunks, args.repeats)
        print(f"| {label} | {best['eager'] * 1e3:.0f} ms | {best['compiled'] * 1e3:.0f} ms | x{best['compiled'] / best['eager']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
