"""The int8 and int4 formats' matrix products: torch's kernels against the engine's own
operators (quantized_linear.cpp), with float32 beside them, in one process.

    .venv/bin/python bench/linears.py [--repeats 5] [--rows 1 32]

Every linear layer of the shipped model (30 layers' q/k/v, o, gate/up and down, and the output
head), laid out in each format, is run once per pass at each number of rows; the formats take
turns within a round, so the machine's noise falls on all of them. Prints the best pass of each,
and each one's time over torch's int8 kernel's.
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

from inference.worker import engines  # noqa: E402
from inference.worker.engine import llama  # noqa: E402

MODEL = "smollm2-135m-instruct"


def layouts(model):
    """{name: the model's linear layers in that layout}."""
    int8, int4 = (llama.LlamaWeights(model, fmt).linears() for fmt in ("int8", "int4"))
    return {
        "int8, torch's kernel": [torch_int8(layer) for layer in int8],
        "int8, own operator": int8,
        "int4, torch's kernel": [torch_int4(layer) for layer in int4],
        "int4, own operator": int4,
        "float32": llama.LlamaWeights(model, "float32").linears(),
    }


def torch_int8(layer):
    """The operator's int8 layer through torch's kernel: the same weights, bfloat16 activations."""
    return dressed(llama.Int8(layer.dense().float()), layer)


def torch_int4(layer):
    """The operator's int4 layer through torch's kernel (its int8 fallbacks as torch's int8)."""
    if not isinstance(layer, llama.OwnInt4):
        return torch_int8(layer)
    return dressed(llama.Int4(layer.dense().float()), layer)


def dressed(plain, layer):
    plain.bias, plain.in_features = layer.bias, layer.in_features
    return plain


@torch.inference_mode()
def one_pass(layers, inputs):
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    lm = engines.load(MODEL)
    every = layouts(lm.model)
    assert any(type(layer) is llama.OwnInt4 for layer in every["int4, own operator"]), "the operators did not build here"
    for rows in args.rows:
        inputs = {size: torch.randn(rows, size, dtype=lm.model.dtype) for size in (576, 1536)}
        best = dict.fromkeys(every, float("inf"))
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, layers in every.items():
                best[name] = min(best[name], one_pass(layers, inputs))
        base = best["int8, torch's kernel"]
        print(f"{rows} row(s) through every linear layer, best of {args.repeats}:")
        for name, seconds in best.items():
            print(f"  {name:22} {seconds * 1e3:8.2f} ms  x{seconds / base:.2f}")


if __name__ == "__main__":
    main()
