"""What one numeric path costs: the engine's forward pass for a prompt chunk and for decode steps.

    .venv/bin/python bench/one_path.py [--format int4]

Run from a checkout's root, it times that checkout's runner, so two checkouts compare in one
command (see BENCHMARKS.md): a 512-token prompt chunk (the idle prefill chunk), a 24-token
piece beside 31 decodes, and decode steps of 1 and 32 sequences at 300 tokens of context; the
best of several passes each, in milliseconds.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))

from inference.worker.engine import loader  # noqa: E402
from inference.worker.engine.kv_cache import BlockPool  # noqa: E402
from inference.worker.engine.llama import LlamaRunner  # noqa: E402
from inference.worker.engine.runner import Chunk  # noqa: E402

MODEL = "smollm2-135m-instruct"
CONTEXT = 300


def chunk(tokens, start, blocks, prompt):
    """A chunk in this checkout's terms (an older runner marks prompt chunks `wide`)."""
    extra = {"wide": prompt} if "wide" in Chunk.__dataclass_fields__ else {}
    return Chunk(tokens, start, blocks, "bench", **extra)


def best(runner, chunks, repeats=5):
    runner.forward(chunks)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.forward(chunks)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="auto", help="a weight format, or auto (an older runner measures; a newer one needs a name)")
    args = parser.parse_args()
    lm = loader.load(MODEL, Path(__file__).resolve().parent.parent / ".cache" / "models" / MODEL, "cpu")
    pool = BlockPool.for_model(lm.model.config, 40 * 1024, 16, lm.model.dtype, lm.device)
    runner = LlamaRunner(lm.model, pool, lm.device, lm.context_length, args.format)
    tables = [list(range(i * 64, (i + 1) * 64)) for i in range(40)]  # 1,024 tokens each
    ids = list(range(1000, 1000 + 512))
    figures = {
        "prompt chunk 512": best(runner, [chunk(ids, 0, tables[0], True)]),
        "decode 1": best(runner, [chunk([5], CONTEXT, tables[0], False)]),
        "decode 32": best(runner, [chunk([5], CONTEXT, tables[i], False) for i in range(32)]),
        "decode 31 + piece 24": best(runner, [chunk([5], CONTEXT, tables[i], False) for i in range(31)] + [chunk(ids[:24], CONTEXT, tables[39], True)]),
    }
    print(f"{ROOT.name}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in figures.items()))


if __name__ == "__main__":
    main()
