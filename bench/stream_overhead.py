"""What the service path costs over the bare engine, for one stream with the real model.

Runs both in one command, so the machine's noise hits both alike:
  baseline: Engine.step() in this process (prefill + greedy decode), no Django, Celery or Redis;
  service:  POST /v1/chat/completions stream=true through Daphne, Celery, the Redis Stream log.
Prints time to first token and tokens/s for each, the ratios, and the CPU time each of the
service's processes (worker, Daphne, Redis) spent per streamed token.

    .venv/bin/python bench/stream_overhead.py [--runs 5] [--tokens 64]
"""

import argparse
import os
import statistics
import sys
import time
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
MESSAGES = [{"role": "user", "content": "Tell me about the history of tea in a few paragraphs."}]


def engine_run(engine, prompt, tokens):
    start = time.perf_counter()
    engine.add(Request(str(start), prompt, SamplingParams(max_tokens=tokens, temperature=0)))
    first, count = None, 0
    while engine.has_work():
        for output in engine.step():
            first = first or time.perf_counter()
            count = output.completion_tokens
    return first - start, count / (time.perf_counter() - first)


def service_run(url, key, tokens):
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "temperature": 0, "max_tokens": tokens,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first = count = None
    with serving.http().stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        for line in r.iter_lines():
            # The first chunk only names the role (sent on admission): the first token's has text.
            if line.startswith("data: {") and first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter()
            if '"usage":{"prompt_tokens"' in line:
                count = int(line.split('"completion_tokens":')[1].split(",")[0])
    return first - start, count / (time.perf_counter() - first)


def cpu_seconds(pid):
    """User and system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_processes(children):
    import redis

    redis_pid = redis.Redis.from_url(os.environ["REDIS_URL"]).info("server")["process_id"]
    return {"worker": children[0].pid, "daphne": children[1].pid, "redis": redis_pid}


def start_service(port):
    return serving.start_service(ROOT, port, WORK / "service.log", {**os.environ, "PYTHONUNBUFFERED": "1"})


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
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    _, key = ApiKey.issue("bench")
    children = start_service(args.port)
    try:
        model = engines.load(MODEL)
        engine = build_engine(model)  # as the worker builds it
        prompt = model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        engine_run(engine, prompt, 4)  # warm up
        service_run(f"http://127.0.0.1:{args.port}", key, 4)
        base, service, cpu = [], [], dict.fromkeys(processes := service_processes(children), 0.0)
        for _ in range(args.runs):  # interleaved, so drift in the machine's speed hits both
            base.append(engine_run(engine, prompt, args.tokens))
            before = {name: cpu_seconds(pid) for name, pid in processes.items()}
            service.append(service_run(f"http://127.0.0.1:{args.port}", key, args.tokens))
            for name, pid in processes.items():
                cpu[name] += cpu_seconds(pid) - before[name]
    finally:
        for child in children:
            child.terminate()
    b, s = summary("engine", base), summary("service", service)
    print(f"service/engine: TTFT x{s[0] / b[0]:.2f}, tokens/s x{s[1] / b[1]:.2f}")
    # Where the service's CPU goes (2 cores: what the others take, the engine's matrix products lack).
    tokens = args.runs * args.tokens
    print("CPU ms per streamed token: " + ", ".join(f"{name} {seconds * 1000 / tokens:.2f}" for name, seconds in cpu.items()))


if __name__ == "__main__":
    main()
