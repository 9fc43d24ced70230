"""A step's choice of next tokens: each row on its own (the sampling code of an earlier commit)
against the batch together (this tree's sampling.choose), in one process.

    .venv/bin/python bench/sampling.py [--rev 9f5f44b] [--repeats 30]

For 1, 8 and 32 rows of the shipped model's own logits (its next-token scores along a passage
of text): all greedy; all sampled with their own seeds at temperature 1 (the API's default);
and at temperature 0.8 with top-p 0.95. Prints milliseconds a step (the median of `repeats`,
the picks moved to the host once, as the engine does) and the ratio old / new.
"""

import argparse
import statistics
import subprocess
import sys
import time
import types
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inference.worker.engine import loader, sampling  # noqa: E402

MODEL = "smollm2-135m-instruct"
PASSAGE = (
    "The lighthouse keeper climbed the stairs each evening, counting the steps as his father had. "
    "At the top he trimmed the wick, polished the lens and watched the ships come in from the grey sea, "
    "their lights small and steady against the coming dark. Some nights the fog was so thick that"
)
KINDS = {"greedy": dict(temperature=0.0), "seeded, temperature 1": dict(temperature=1.0), "seeded, top-p 0.95": dict(temperature=0.8, top_p=0.95)}


def old_sampling(rev):
    """The sampling module as it was at `rev`, loaded beside this tree's."""
    source = subprocess.run(["git", "show", f"{rev}:inference/worker/engine/sampling.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("old_sampling")
    exec(compile(source, "old_sampling", "exec"), module.__dict__)
    return module


def per_row(old, logits, params, generators):
    return torch.stack([old.sample(row, p, g) for row, p, g in zip(logits, params, generators)]).tolist()


def together(logits, params, generators):
    return sampling.choose(logits.float(), params, generators).tolist()


def model_logits(rows):
    """The model's scores for the next token at the passage's last `rows` positions: [rows, V]."""
    lm = loader.load(MODEL, ROOT / ".cache" / "models" / MODEL, "cpu")
    ids = lm.tokenizer(PASSAGE, return_tensors="pt").input_ids
    with torch.inference_mode():
        return lm.model(ids).logits[0, -rows:].float()


def median_ms(pick, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pick()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", default="9f5f44b", help="the commit whose sampling runs row by row")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    old = old_sampling(args.rev)
    logits = model_logits(32)
    print(f"{'rows':>4}  {'kind':<20} {'row by row ms':>14} {'together ms':>12} {'ratio':>6}")
    for rows in (1, 8, 32):
        for kind, knobs in KINDS.items():
            params = [old.SamplingParams(seed=i, **knobs) for i in range(rows)]
            new_params = [sampling.SamplingParams(seed=i, **knobs) for i in range(rows)]
            gens = [old.make_generator(i, "cpu") for i in range(rows)]
            before = median_ms(partial(per_row, old, logits[:rows], params, gens), args.repeats)
            after = median_ms(partial(together, logits[:rows], new_params, gens), args.repeats)
            print(f"{rows:>4}  {kind:<20} {before:>14.2f} {after:>12.2f} {before / after:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
