"""The CPU operators of a commit against the working tree's, in one process.

    .venv/bin/python bench/operators_ab.py [--base HEAD] [--rows 1 8 32 128] [--repeats 25]

Both trees' sources (cpu_ops.SOURCES and HEADERS) are built, each under a namespace of its own,
and take turns on the shipped model's linear layers (q/k/v, o, gate/up, down; random weights in
the int4 and int8 layouts) and on attention (32 rows at 300 and 2,000 tokens of a bfloat16
cache), so the machine's noise falls on both: two runs of one build differ by up to 30% on
these machines, far more than most changes to an operator. Prints the best time of each, the
working tree's over the base's, and whether their outputs are the same bit for bit.
"""

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.worker.engine import cpu_ops  # noqa: E402

LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q/k/v, o, gate/up, down: (out, in)
BLOCK = 16  # the KV cache's block size


def built(tree, namespace, folder):
    """The operators of `tree` (a commit, or None: the working tree) as torch.ops.<namespace>."""
    folder.mkdir()
    sources = []
    for path in cpu_ops.SOURCES + cpu_ops.HEADERS:
        text = source(tree, path)
        if text is None:
            continue  # a header the base did not have yet, nor included
        (folder / path.name).write_text(re.sub(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\(tokstream,", rf"TORCH_LIBRARY_\1({namespace},", text))
        sources += [folder / path.name] if path in cpu_ops.SOURCES else []
    cpu_ops.build(folder / "ops.so", sources)
    torch.ops.load_library(str(folder / "ops.so"))
    return getattr(torch.ops, namespace)


def source(tree, path):
    """The file's text in `tree` (None: as it is now), or None where a header is not in it."""
    if tree is None:
        return path.read_text()
    shown = subprocess.run(["git", "show", f"{tree}:{path.relative_to(ROOT).as_posix()}"], cwd=ROOT, capture_output=True, text=True)
    if shown.returncode != 0 and path in cpu_ops.HEADERS:
        return None
    shown.check_returncode()
    return shown.stdout


def cases(rows):
    """{name: (operator name, its inputs for each layer)} for `rows` rows."""
    generator = torch.Generator().manual_seed(rows)
    int4, int8 = [], []
    for out, inp in LINEARS:
        x = torch.randn(rows, inp, generator=generator)
        codes = torch.randint(0, 256, (out // 8, inp // 32, 128), dtype=torch.uint8, generator=generator)
        scales, minimums = (torch.rand(out // 8, inp // 32, 8, generator=generator).half() for _ in range(2))
        int4.append((x, codes, scales, minimums))
        int8.append((x, torch.randint(-127, 128, (out // 8, inp // 32, 256), dtype=torch.int8, generator=generator), torch.rand(out, generator=generator)))
    return {f"int4, {rows} rows": ("int4_linear", int4), f"int8, {rows} rows": ("int8_linear", int8)}


def attention(rows, context):
    generator = torch.Generator().manual_seed(context)
    width = -(-context // BLOCK)
    blocks = rows * width
    k, v = (torch.randn(blocks * BLOCK, 3, 64, generator=generator).bfloat16() for _ in range(2))
    tables = torch.randperm(blocks, generator=generator).view(rows, width)
    q = torch.randn(rows, 9, 64, generator=generator)
    return {f"attention, {rows} x {context}": ("paged_attention", [(q, k, v, tables, torch.full((rows,), context - 1), BLOCK)])}


@torch.inference_mode()
def best_times(sides, name, calls, repeats):
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(repeats):
        for side, ops in sides.items():
            op = getattr(ops, name)
            start = time.perf_counter()
            for args in calls:
                op(*args)
            best[side] = min(best[side], time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        sides = {args.base: built(args.base, "ab_base", Path(folder) / "base"), "working tree": built(None, "ab_tree", Path(folder) / "tree")}
        every = {}
        for rows in args.rows:
            every.update(cases(rows))
        every.update(attention(32, 300))
        every.update(attention(32, 2000))
        print(f"{args.base} against the working tree, best of {args.repeats}, {torch.get_num_threads()} threads")
        for case, (name, calls) in every.items():
            base, tree = best_times(sides, name, calls, args.repeats).values()
            same = all(torch.equal(*(getattr(ops, name)(*call) for ops in sides.values())) for call in calls)
            print(f"  {case:24} {base * 1e3:8.3f} ms  {tree * 1e3:8.3f} ms  x{tree / base:.2f}  {'the same outputs' if same else 'other outputs'}")


if __name__ == "__main__":
    main()
