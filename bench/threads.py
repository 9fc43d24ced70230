"""Why the worker's engine thread loads its own model: a decode step on the thread that loaded
and warmed the engine, against the same step on a second thread, alternated in one process.

torch's OpenMP (libgomp) keeps a team of threads for each thread that runs a parallel
operation; with two teams on a 2-core machine it manages more threads than there are cores and
stops spinning between operations, so every operation of the step waits for its team to wake.

    .venv/bin/python bench/threads.py [--runs 3] [--tokens 100]
"""

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

from inference.worker import engines  # noqa: E402
from inference.worker.engine import Engine, Request, SamplingParams  # noqa: E402

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Tell me about the history of tea in a few paragraphs."}]


def step_ms(engine, prompt, tokens):
    """Mean milliseconds per engine step over one greedy reply of `tokens` tokens."""
    engine.add(Request(str(time.perf_counter()), prompt, SamplingParams(max_tokens=tokens, temperature=0)))
    steps, spent = 0, 0.0
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        spent += time.perf_counter() - start
        steps += 1
    return spent / steps * 1000


def on_other_thread(engine, prompt, tokens):
    result = []
    thread = threading.Thread(target=lambda: result.append(step_ms(engine, prompt, tokens)))
    thread.start()
    thread.join()
    return result[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    lm = engines.load(MODEL, "cpu")
    engine = Engine.for_model(lm, 16_000, weights=settings.TOKSTREAM_WEIGHTS)
    prompt = lm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    step_ms(engine, prompt, 4)  # warm up, on this (the loading) thread
    same, other = [], []
    for _ in range(args.runs):
        same.append(step_ms(engine, prompt, args.tokens))
        other.append(on_other_thread(engine, prompt, args.tokens))
        print(f"step on the loading thread {same[-1]:.1f} ms, on another thread {other[-1]:.1f} ms", flush=True)
    print(f"another thread / the loading thread: x{statistics.median(other) / statistics.median(same):.2f} (medians of {args.runs})")


if __name__ == "__main__":
    main()
