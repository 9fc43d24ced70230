"""Whether the engine's step waits for the GIL: decode steps of 32 sequences alone, then beside
one Python thread that only counts (as a busy Celery thread would be), at several GIL switch
intervals. torch runs on one thread here, so the counting thread has a core of its own and
any slowdown of the steps is the GIL's hand-over, not a shared core.

    .venv/bin/python bench/gil.py [--seconds 3]
"""

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import engine as bench_engine  # noqa: E402  (bench/engine.py)

from inference.worker.engine import loader  # noqa: E402

INTERVALS = (0.005, 0.0005, 0.005)  # seconds; 5 ms is CPython's default


def decoding_engine(batch=32):
    lm = loader.load(bench_engine.MODEL, ROOT / ".cache" / "models" / bench_engine.MODEL, loader.pick_devices()[0])
    engine, requests = bench_engine.start_all(lm, bench_engine.prompts(lm.tokenizer, batch), 4096)
    while engine.load()[1] or any(r.first_token_at is None for r in requests):
        engine.step()
    return engine


def steps_per_second(engine, seconds, beside_a_busy_thread):
    running = threading.Event()
    running.set()

    def count():
        n = 0
        while running.is_set():
            n += 1

    counter = threading.Thread(target=count, daemon=True)
    if beside_a_busy_thread:
        counter.start()
    started, steps = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        engine.step()
        steps += 1
    running.clear()
    if beside_a_busy_thread:
        counter.join()
    return steps / (time.perf_counter() - started)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="of steps for each figure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = decoding_engine()
    for interval in INTERVALS:
        sys.setswitchinterval(interval)
        alone = steps_per_second(engine, args.seconds, False)
        beside = steps_per_second(engine, args.seconds, True)
        print(f"switch interval {interval * 1000:.1f} ms: {alone:.1f} steps/s alone, {beside:.1f} beside a busy thread (x{beside / alone:.2f})")


if __name__ == "__main__":
    main()
