"""Requests arriving together through the whole service: their time to first token, and the gaps
of streams already running, measured from the client as a user sees them (issue 22's targets).

The service (Daphne, the Celery worker, Redis) starts on its shipped defaults. Each round:
  idle:   --arrivals chat requests (default 32) fired at once at an idle service;
  beside: --running streams (default 4) stream long replies; once their gaps are steady, as many
          requests arrive together as fill the shipped batch beside them (32 in all).
For each round: newcomers' time to first token (p50, p95, from the moment they were fired); the
running streams' gaps (between chunks with text) before the burst (their usual), during it (from
the burst until the last newcomer's first token, the worst) and after it (at the new width).

    .venv/bin/python bench/burst.py [--rounds 3] [--tokens 64]
"""

import argparse
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import serving  # noqa: E402  (bench/serving.py)

WORK = serving.setup("burst", 12)

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402

from billing.models import ApiKey, UsageEntry  # noqa: E402

MODEL = "smollm2-135m-instruct"
NO_STOP = {"0": -100, "1": -100, "2": -100}  # the running streams must outlast the burst


def stream(url, key, text, tokens, bias=None, stop=None):
    """Stream one chat completion; -> the client's clock at each chunk with text."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": True, "temperature": 0, "max_tokens": tokens}
    if bias:
        body["logit_bias"] = bias
    times = []
    for chunk in serving.chunks(url, key, body):
        if serving.has_text(chunk):
            times.append(time.perf_counter())
        if stop is not None and stop.is_set():
            break  # closing the stream cancels the request
    return times


def fire(pool, url, key, first, count, tokens):
    """`count` requests at once; -> (the moment they were fired, their futures)."""
    t0 = time.perf_counter()
    return t0, [pool.submit(stream, url, key, serving.question(n), tokens) for n in range(first, first + count)]


def ttfts(t0, futures):
    return sorted(f.result()[0] - t0 for f in futures)


def percentile(values, share):
    return values[min(len(values) - 1, int(len(values) * share))]


def gaps_between(times, start, end):
    return [b - a for a, b in zip(times, times[1:]) if start <= b <= end]


def idle_round(pool, url, key, first, count, tokens):
    fired = time.time()
    t0, futures = fire(pool, url, key, first, count, tokens)
    times = ttfts(t0, futures)
    return {"p50": statistics.median(times), "p95": percentile(times, 0.95), **seams(fired, count)}


def seams(fired, count):
    """Where the newcomers' time to first token went, by the ledger's clock (medians): from
    being fired to the web's receiving them, to the engine's starting them, to the first token."""
    since = datetime.fromtimestamp(fired - 0.05, UTC)
    for _ in range(50):  # the worker writes an entry as its stream ends
        entries = list(UsageEntry.objects.filter(received_at__gte=since, first_token_at__isnull=False))
        if len(entries) >= count:
            break
        time.sleep(0.1)
    else:
        return {}
    received = [e.received_at.timestamp() - fired for e in entries]
    started = [(e.started_at - e.received_at).total_seconds() for e in entries]
    first = [(e.first_token_at - e.started_at).total_seconds() for e in entries]
    return {
        "received": statistics.median(received),
        "last received": max(received),
        "claimed": statistics.median(started),
        "computed": statistics.median(first),
    }


def beside_round(pool, url, key, first, running, arrivals, tokens):
    """`arrivals` requests together beside `running` long streams; -> TTFTs and the gaps."""
    stop = threading.Event()
    streams = [pool.submit(stream, url, key, serving.question(first + n), 2000, NO_STOP, stop) for n in range(running)]
    time.sleep(3.0)  # every running stream past its prompt, decoding at its usual pace
    t0, futures = fire(pool, url, key, first + running, arrivals, tokens)
    times = ttfts(t0, futures)
    last_first = t0 + times[-1]
    time.sleep(2.0)  # the gaps at the new width
    stop.set()
    chunks = [s.result() for s in streams]
    before = [g for c in chunks for g in gaps_between(c, t0 - 2.0, t0)]
    during = [g for c in chunks for g in gaps_between(c, t0, last_first)]
    after = [g for c in chunks for g in gaps_between(c, last_first + 0.5, last_first + 2.0)]
    return {
        "p50": statistics.median(times), "p95": percentile(times, 0.95),
        "usual": statistics.median(before), "worst": max(during), "after": statistics.median(after),
    }  # fmt: skip


def report(label, rounds):
    p50, p95 = (statistics.median(r[k] for r in rounds) * 1000 for k in ("p50", "p95"))
    line = f"{label}: TTFT p50 {p50:.0f} ms, p95 {p95:.0f} ms"
    if "received" in rounds[0]:
        parts = ", ".join(f"{k} {statistics.median(r[k] for r in rounds) * 1000:.0f} ms" for k in ("received", "last received", "claimed", "computed"))
        line += f" (the ledger's medians: {parts})"
    if "usual" in rounds[0]:
        usual, worst, after = (statistics.median(r[k] for r in rounds) for k in ("usual", "worst", "after"))
        line += (
            f"; running streams' gap {usual * 1000:.0f} ms before, worst {worst * 1000:.0f} ms during (x{worst / usual:.2f} of before, "
            f"x{worst / after:.2f} of after), {after * 1000:.0f} ms after"
        )
    print(line + f" (medians of {len(rounds)} rounds)", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="each newcomer's reply")
    parser.add_argument("--arrivals", type=int, default=32, help="requests arriving together at the idle service")
    parser.add_argument("--running", type=int, default=4, help="streams running when the second burst arrives")
    parser.add_argument("--port", type=int, default=8097)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    _, key = ApiKey.issue("bench-burst")
    url = f"http://127.0.0.1:{args.port}"
    width = settings.TOKSTREAM_MAX_RUNNING
    children = serving.start_service(ROOT, args.port, WORK / "service.log", {**os.environ, "PYTHONUNBUFFERED": "1"}, width)
    idle, beside = [], []
    try:
        with ThreadPoolExecutor(args.arrivals + width) as pool:
            idle_round(pool, url, key, 90_000, 2, 4)  # warm up
            for n in range(args.rounds):
                idle.append(idle_round(pool, url, key, 1000 * n, args.arrivals, args.tokens))
                time.sleep(1.0)
                beside.append(beside_round(pool, url, key, 1000 * n + 500, args.running, width - args.running, args.tokens))
                time.sleep(1.0)
                print(f"round {n + 1}/{args.rounds}: idle {idle[-1]['p50'] * 1000:.0f} ms p50, beside {beside[-1]['p50'] * 1000:.0f} ms p50; "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    finally:
        for child in children:
            child.terminate()
    report(f"{args.arrivals} arriving together at an idle service", idle)
    report(f"{width - args.running} arriving together beside {args.running} running streams", beside)


if __name__ == "__main__":
    main()
