"""What the service path costs over the bare engine, with the real model: one stream, or
--concurrent N streams arriving together (the issue's "≥ 90% of the engine's bare batched loop").

Runs both in one command, so the machine's noise hits both alike:
  baseline: Engine.step() in this process (prefill + greedy decode), no Django, Celery or Redis;
  service:  POST /v1/chat/completions stream=true through Daphne, Celery, the Redis Stream log.
Both get the same prompts, new ones each run (no whole prompt is found cached). Prints the
median time to first token and tokens/s for each (per stream for one; for N, every stream's
tokens over the wall time from arrival to the last token), the ratios, and the CPU time each
of the service's processes (worker, Daphne, Redis) spent per streamed token.

    .venv/bin/python bench/stream_overhead.py [--runs 5] [--tokens 64] [--concurrent 1]
"""

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import serving  # noqa: E402  (bench/serving.py)

WORK = serving.setup("bench", 14)

from django.core.management import call_command  # noqa: E402

from billing.models import ApiKey  # noqa: E402
from inference.worker import engines  # noqa: E402
from inference.worker.engine import Request, SamplingParams  # noqa: E402
from inference.worker.engines import build_engine  # noqa: E402

MODEL = "smollm2-135m-instruct"


def messages(n):
    return [{"role": "user", "content": serving.question(n)}]


def engine_run(engine, prompts, tokens):
    """The prompts added together; -> (median time to first token, tokens/s)."""
    start = time.perf_counter()
    for n, prompt in enumerate(prompts):
        engine.add(Request(f"{start}-{n}", prompt, SamplingParams(max_tokens=tokens, temperature=0)))
    first, counts = {}, {}
    while engine.has_work():
        for output in engine.step():
            first.setdefault(output.request_id, time.perf_counter())
            counts[output.request_id] = output.completion_tokens
    return rates(start, list(first.values()), sum(counts.values()))


def rates(start, firsts, count):
    """One stream: its decode rate after the first token; several: all their tokens over the
    wall time from their arrival to the last token, prefill included."""
    end = time.perf_counter()
    ttft = statistics.median(firsts) - start
    if len(firsts) == 1:
        return ttft, (count - 1) / (end - firsts[0])
    return ttft, count / (end - start)


def service_stream(url, key, batch, tokens):
    """-> (the client's clock at its first token, its completion tokens)."""
    body = {"model": MODEL, "messages": batch, "stream": True, "temperature": 0, "max_tokens": tokens, "stream_options": {"include_usage": True}}
    first = count = None
    for chunk in serving.chunks(url, key, body):
        if first is None and chunk["choices"] and serving.has_text(chunk):
            first = time.perf_counter()
        if chunk.get("usage"):
            count = chunk["usage"]["completion_tokens"]
    return first, count


def service_run(pool, url, key, batches, tokens):
    """-> (median time to first token, tokens/s, the tokens streamed)."""
    start = time.perf_counter()
    results = list(pool.map(lambda batch: service_stream(url, key, batch, tokens), batches))
    count = sum(r[1] for r in results)
    return *rates(start, [r[0] for r in results], count), count


def cpu_seconds(pid):
    """User and system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_processes(children):
    import redis

    redis_pid = redis.Redis.from_url(os.environ["REDIS_URL"]).info("server")["process_id"]
    # The client too: its streams' parsing takes the same 2 cores (the engine alone has none).
    return {"worker": children[0].pid, "daphne": children[1].pid, "redis": redis_pid, "client": os.getpid()}


def start_service(port, concurrent):
    return serving.start_service(ROOT, port, WORK / "service.log", {**os.environ, "PYTHONUNBUFFERED": "1"}, max(4, concurrent))


def summary(name, runs):
    ttft = statistics.median(r[0] for r in runs) * 1000
    rate = statistics.median(r[1] for r in runs)
    print(f"{name:9s} TTFT {ttft:7.1f} ms   {rate:6.1f} tokens/s   (median of {len(runs)})")
    return ttft, rate


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--concurrent", type=int, default=1, help="streams arriving together in each run")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    _, key = ApiKey.issue("bench")
    children = start_service(args.port, args.concurrent)
    url, width = f"http://127.0.0.1:{args.port}", args.concurrent
    try:
        model = engines.load(MODEL)
        engine = build_engine(model)  # as the worker builds it
        pool = ThreadPoolExecutor(width)
        batches = [[messages(width * run + n) for n in range(width)] for run in range(args.runs + 1)]
        prompts = [[model.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in batch] for batch in batches]
        engine_run(engine, prompts[0], 4)  # warm up
        service_run(pool, url, key, batches[0], 4)
        base, service, cpu = [], [], dict.fromkeys(processes := service_processes(children), 0.0)
        for run in range(1, args.runs + 1):  # interleaved, so drift in the machine's speed hits both
            base.append(engine_run(engine, prompts[run], args.tokens))
            before = {name: cpu_seconds(pid) for name, pid in processes.items()}
            service.append(service_run(pool, url, key, batches[run], args.tokens))
            for name, pid in processes.items():
                cpu[name] += cpu_seconds(pid) - before[name]
    finally:
        for child in children:
            child.terminate()
    b, s = summary("engine", base), summary("service", service)
    print(f"service/engine ({width} at once): TTFT x{s[0] / b[0]:.2f}, tokens/s x{s[1] / b[1]:.2f}")
    # Where the service's CPU goes (2 cores: what the others take, the engine's matrix products lack).
    tokens = sum(run[2] for run in service)
    print("CPU ms per streamed token: " + ", ".join(f"{name} {seconds * 1000 / tokens:.2f}" for name, seconds in cpu.items()))


if __name__ == "__main__":
    main()
