"""The service against llama.cpp on the same GGUF and machine, in one command, runs interleaved.

  llama.cpp: llama-cpp-python 0.3.36 in a subprocess, from a virtual environment of this
             benchmark's own (.cache/peer-venv, built from source on first use, reused later;
             the service's .venv never gets llama_cpp). One `Llama` object, n_threads=2, the
             GGUF the service converts, the messages through the GGUF's own chat template
             (`create_chat_completion`, stream=True), greedy, measured inside that process.
  service:   POST /v1/chat/completions stream=true through Daphne, the Celery worker and the
             Redis Stream log (bench/serving.py), measured from the client.

Cases: one stream, and 4 concurrent streams (--concurrent N). The service runs them at once (its
engine batches them). llama.cpp runs them one after another in its one `Llama` object: llama-cpp-python's own
server is no fairer a peer, since it serializes requests behind a lock (and by default a new
request interrupts the one streaming). All 4 arrive at once, so a queued stream's time to first
token includes the streams before it, as its client would see.

Each stream gets a prompt of its own (same list for both sides), so neither side finds a whole
prompt cached; both may reuse the shared head of the chat template (the default system turn).
Completion tokens come from each side's usage: the service's final usage chunk; llama-cpp-python
streams no usage, so the peer counts the tokens its sampler hands to `create_completion` (less
an end-of-turn token), which is what its non-streaming usage counts, checked once at start.

Time to first token: to the first chunk that carries text (the service's first chunk, with the
role and queue position, comes at admission, before any token).
Per stream tokens/s: (completion tokens - 1) / (last token - first token), decode only.
Aggregate tokens/s: all completion tokens of a case / its wall time, prefill included.
Medians over all streams (TTFT, per stream) or over runs (aggregate); best: the fastest run.
llama.cpp's threads spin at their barriers, so when other work takes one of 2 cores its speed
collapses (seen: 80 -> 3 tok/s) where torch slows gently: the per-run lines and best show it.

The first run builds llama.cpp from source (about 8 minutes on 2 cores); later runs take about
2.5 minutes.

    .venv/bin/python bench/peer.py [--runs 5] [--tokens 64]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import serving  # noqa: E402  (bench/serving.py)

WORK = serving.setup("peer", 13)

from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402

from billing.models import ApiKey  # noqa: E402
from inference.model_files import package_file  # noqa: E402

MODEL = "smollm2-135m-instruct"
LLAMA_CPP = "llama-cpp-python==0.3.36"
PEER_VENV = ROOT / ".cache" / "peer-venv"
PEER_MARK = PEER_VENV / "tokstream-peer.json"
THREADS = 2

# Runs in the peer venv's python. One JSON line in per batch of prompts, one JSON line out.
PEER_SCRIPT = r"""
import json, sys, time
import llama_cpp
from llama_cpp import Llama

llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), n_ctx=4096, verbose=False)
generate = llm.generate
seen = {}

def counting_generate(tokens, *args, **kwargs):
    # llama-cpp-python streams no usage: count what its sampler yields, as its usage does
    # (an end-of-generation token ends the completion and is not part of it).
    seen.update(prompt=len(tokens), completion=0)
    for token in generate(tokens, *args, **kwargs):
        if not llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            seen["completion"] += 1
        yield token

llm.generate = counting_generate

def stream(prompt, max_tokens, t0):
    messages = [{"role": "user", "content": prompt}]
    first = last = None
    for chunk in llm.create_chat_completion(messages, stream=True, temperature=0, max_tokens=max_tokens):
        if chunk["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            first = first or last
    end = time.perf_counter()
    return {"ttft": first - t0, "decode": last - first, "end": end - t0, "completion": seen["completion"], "prompt": seen["prompt"]}

def check(prompt, max_tokens):
    # The counter against llama-cpp-python's own (non-streaming) usage for the same request.
    messages = [{"role": "user", "content": prompt}]
    usage = llm.create_chat_completion(messages, temperature=0, max_tokens=max_tokens)["usage"]
    counted = stream(prompt, max_tokens, time.perf_counter())
    return {"usage": usage["completion_tokens"], "counted": counted["completion"], "prompt": usage["prompt_tokens"], "counted_prompt": counted["prompt"]}

print(json.dumps({"chat_format": llm.chat_format}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    if job.get("check"):
        print(json.dumps(check(job["prompts"][0], job["max_tokens"])), flush=True)
        continue
    t0 = time.perf_counter()  # all prompts arrive at once; they are served one after another
    print(json.dumps([stream(p, job["max_tokens"], t0) for p in job["prompts"]]), flush=True)
"""


def peer_python():
    """The peer venv's python, building the venv (llama-cpp-python from source) the first time."""
    python = PEER_VENV / "bin" / "python"
    mark = json.loads(PEER_MARK.read_text()) if PEER_MARK.is_file() else {}
    if mark.get("package") == LLAMA_CPP:
        print(f"peer venv: reused .cache/peer-venv ({LLAMA_CPP}, its build took {mark['build_s']:.0f} s)")
        return python
    print(f"peer venv: building .cache/peer-venv with {LLAMA_CPP} (compiles llama.cpp; minutes)", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", LLAMA_CPP], check=True)
    elapsed = time.perf_counter() - start
    # Written last: a venv without this mark is an interrupted build, redone next time.
    PEER_MARK.write_text(json.dumps({"package": LLAMA_CPP, "build_s": elapsed}))
    print(f"peer venv: built in {elapsed:.0f} s")
    return python


class Peer:
    """llama.cpp in its own process; the model loads once, jobs go over stdin and stdout."""

    def __init__(self, python, gguf, log_path):
        self.log_path = log_path
        command = [str(python), "-c", PEER_SCRIPT, str(gguf), str(THREADS)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True)
        self.chat_format = self.read()["chat_format"]

    def read(self):
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the llama.cpp peer stopped; see {self.log_path}")
        return json.loads(line)

    def ask(self, job):
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        return self.read()

    def streams(self, prompts, tokens):
        return [with_rate(r) for r in self.ask({"prompts": prompts, "max_tokens": tokens})]

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=10)


def with_rate(result):
    tokens, decode = result["completion"], result["decode"]
    return {**result, "rate": (tokens - 1) / decode if tokens > 1 and decode > 0 else float("nan")}


def service_stream(url, key, prompt, tokens, t0):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True, "temperature": 0, "max_tokens": tokens,
            "stream_options": {"include_usage": True}}  # fmt: skip
    first = last = usage = None
    for chunk in serving.chunks(url, key, body):
        usage = chunk.get("usage") or usage
        if serving.has_text(chunk):
            last = time.perf_counter()
            first = first or last
    end = time.perf_counter()
    result = {"ttft": first - t0, "decode": last - first, "end": end - t0}
    return with_rate({**result, "completion": usage["completion_tokens"], "prompt": usage["prompt_tokens"]})


def service_streams(url, key, prompts, tokens):
    with ThreadPoolExecutor(len(prompts)) as pool:
        t0 = time.perf_counter()
        futures = [pool.submit(service_stream, url, key, p, tokens, t0) for p in prompts]
        return [f.result() for f in futures]


def prompts(first, count):
    return [serving.question(n) for n in range(first, first + count)]


def summary(batches):
    streams = [s for batch in batches for s in batch]
    return {
        "ttft": statistics.median(s["ttft"] for s in streams) * 1000,
        "rate": statistics.median(s["rate"] for s in streams),
        "aggregate": statistics.median(aggregate(b) for b in batches),
        # Best run: llama.cpp's spinning threads collapse when other work takes a core.
        "best": max(aggregate(b) for b in batches),
        "completion": sum(s["completion"] for s in streams),
        "streams": len(streams),
        "prompt": statistics.median(s["prompt"] for s in streams),
    }


def print_table(results, runs):
    print(f"\n{'case':10s} {'side':18s} {'TTFT ms':>9s} {'tok/s/stream':>13s} {'tok/s total':>12s} {'best':>6s} {'completion tokens':>24s} {'prompt tok':>10s}")
    for case, sides in results.items():
        peer, service = summary(sides["llama.cpp"]), summary(sides["service"])
        for name, s in (("llama.cpp", peer), ("service", service)):
            tokens = f"{s['completion']} in {s['streams']} streams"
            print(f"{case:10s} {name:18s} {s['ttft']:9.1f} {s['rate']:13.1f} {s['aggregate']:12.1f} {s['best']:6.1f} {tokens:>24s} {s['prompt']:10.0f}")
        ttft, rate, total, best = (f"x{service[k] / peer[k]:.2f}" for k in ("ttft", "rate", "aggregate", "best"))
        print(f"{case:10s} {'service/llama.cpp':18s} {ttft:>9s} {rate:>13s} {total:>12s} {best:>6s}")
    print(f"(medians of {runs} runs: TTFT and tok/s/stream over every stream, tok/s total over runs; best: the fastest run's total)")


def check_peer_counting(peer):
    """The peer's token counter must agree with llama-cpp-python's own usage, or its figures lie."""
    for prompt, tokens in (("Reply with the single word: yes.", 16), (prompts(10_000, 1)[0], 8)):
        got = peer.ask({"check": True, "prompts": [prompt], "max_tokens": tokens})
        if (got["usage"], got["prompt"]) != (got["counted"], got["counted_prompt"]):
            raise SystemExit(f"the peer's token count disagrees with llama-cpp-python's usage: {got}")
    print(f"peer token count matches llama-cpp-python's usage (last check: {got['usage']} completion tokens)")


def run_case(peer, url, key, count, first, tokens, order):
    batch = prompts(first, count)
    results = {}
    for side in order:  # which side goes first alternates between runs
        results[side] = peer.streams(batch, tokens) if side == "llama.cpp" else service_streams(url, key, batch, tokens)
    return results


def aggregate(batch):
    return sum(s["completion"] for s in batch) / max(s["end"] for s in batch)


def print_run(run, runs, results):
    # Each run's totals, so a run that other work on the machine slowed shows up.
    figures = ", ".join(f"{case} {side} {aggregate(sides[side][-1]):.1f}" for case, sides in results.items() for side in sides)
    print(f"run {run + 1}/{runs}, tok/s total: {figures}; load {os.getloadavg()[0]:.1f}", flush=True)


def measure(peer, url, key, args, generate):
    many = f"{args.concurrent} streams"
    results = {"1 stream": {"llama.cpp": [], "service": []}, many: {"llama.cpp": [], "service": []}}
    for run in range(args.runs):  # interleaved, so drift in the machine's speed hits both
        order = ("llama.cpp", "service") if run % 2 == 0 else ("service", "llama.cpp")
        for case, count in (("1 stream", 1), (many, args.concurrent)):
            for side, batch in run_case(peer, url, key, count, run * 100 + count, args.tokens, order).items():
                results[case][side].append(batch)
        if generate:
            generate.rates.append(generate.rate(prompts(run * 100 + 50, 2), args.tokens))
        print_run(run, args.runs, results)
    return results


class Generate:
    """transformers `generate`, one request after another, in this process: the baseline the
    concurrent streams are held to (float32, greedy, the chat template, `--tokens` each)."""

    def __init__(self):
        from inference.worker import engines

        self.lm = engines.load(MODEL)
        self.rates = []

    def rate(self, texts, tokens):
        import torch

        start = time.perf_counter()
        for text in texts:
            ids = torch.tensor([self.lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)])
            self.lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=2)
        return len(texts) * tokens / (time.perf_counter() - start)

    def report(self, results, many):
        rate = statistics.median(self.rates)
        service = summary(results[many]["service"])["aggregate"]
        print(f"transformers generate, one request after another: {rate:.1f} tok/s; service, {many} at once: {service:.1f} tok/s total = x{service / rate:.2f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8098)
    parser.add_argument("--concurrent", type=int, default=4, help="streams of the second case")
    parser.add_argument("--generate", action="store_true", help="also time transformers generate, one request after another")
    args = parser.parse_args()
    python = peer_python()
    gguf = package_file(settings.TOKSTREAM_MODELS[MODEL]["source"])  # as the worker finds it
    call_command("migrate", verbosity=0)
    _, key = ApiKey.issue("bench-peer")
    url = f"http://127.0.0.1:{args.port}"
    children = serving.start_service(ROOT, args.port, WORK / "service.log", {**os.environ, "PYTHONUNBUFFERED": "1"}, max(4, args.concurrent))
    peer = None
    try:
        peer = Peer(python, gguf, WORK / "peer.log")
        print(f"llama.cpp: {LLAMA_CPP}, n_threads={THREADS}, chat template {peer.chat_format!r}, {gguf.name}")
        print(f"  {args.concurrent} streams: one after another in one Llama object (its server would serialize them too)")
        print(f"service:   {MODEL} over HTTP, {args.concurrent} streams at once; --runs {args.runs} --tokens {args.tokens}")
        check_peer_counting(peer)
        peer.streams(prompts(20_000, 1), 4)  # warm up both
        service_streams(url, key, prompts(20_000, 1), 4)
        generate = Generate() if args.generate else None
        results = measure(peer, url, key, args, generate)
    finally:
        if peer:
            peer.close()
        for child in children:
            child.terminate()
    print_table(results, args.runs)
    if generate:
        generate.report(results, f"{args.concurrent} streams")


if __name__ == "__main__":
    main()
