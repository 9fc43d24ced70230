"""Soak a running service: N concurrent streams for M minutes, then check what they said.

Each of --streams client loops (asyncio, one httpx connection each) sends streamed greedy
requests back to back, over a fixed list of short prompts, until --minutes are up. Per stream:
time to first content token, the gaps between content chunks, whether it ended with
`data: [DONE]` (unterminated otherwise: a time-out or a connection closed early), an error
event, its text and its token counts. Requests in flight when time is up may finish (each
within --timeout), so a run ends by itself. After the load, one non-streamed greedy reply per
prompt is fetched: with greedy decoding every streamed text of that prompt must equal it, so a
difference is a lost or duplicated character. RSS of the service's processes is sampled
throughout (--pids, else found in /proc: Daphne on the --url's port and its Celery workers).

    .venv/bin/python bench/soak.py --key KEY [--url http://127.0.0.1:8000] [--streams 32]
        [--minutes 10] [--max-tokens 64] [--json out.json]

The key may come from TOKSTREAM_KEY instead (then it stays out of the printed command line).
Only loopback URLs are accepted: this generates load and is meant for a service of your own.
"""

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MODEL = "smollm2-135m-instruct"
# Short and varied, so replies differ in length and some stop before max_tokens.
PROMPTS = [
    "Write a haiku about tea.",
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Tell me a short joke about cats.",
    "List the days of the week.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "Describe the ocean in five words.",
    "What does HTTP stand for?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have?",
    "Write one sentence about autumn.",
    "What is the boiling point of water in Celsius?",
]
FINISHED = ("stop", "length")  # a reply the non-streamed one must equal
PROGRESS_SECONDS = 60


@dataclass
class Stream:
    """One streamed request, as the client saw it."""

    prompt: int
    request_id: str = ""  # the service's, to find the request in its logs
    started: float = 0.0
    ended: float = 0.0
    status: int = 0
    done: bool = False  # saw `data: [DONE]`
    finish_reason: str = ""
    error: str = ""  # an error event's code or message, or a refusal's
    broken: str = ""  # why it ended without [DONE]: time-out, connection closed, ...
    ttft: float | None = None
    gaps: list = field(default_factory=list)
    text: str = ""
    chunk_tokens: int = 0  # completion tokens as of the last content chunk (continuous usage)
    repeats: int = 0  # content chunks whose token count did not grow: duplicated or reordered
    usage_tokens: int | None = None  # the final usage chunk's completion_tokens
    last_chunk: float = 0.0

    @property
    def outcome(self):
        if self.status and self.status != 200:
            return "rejected"
        if not self.done:
            return "unterminated"
        return "error" if self.error else self.finish_reason or "no_finish_reason"

    @property
    def tokens(self):
        return self.usage_tokens if self.usage_tokens is not None else self.chunk_tokens


class Run:
    """What the client loops share: the deadline, the request budget and the results."""

    def __init__(self, args):
        self.args = args
        self.started = time.monotonic()
        self.deadline = self.started + args.minutes * 60
        self.budget = args.max_requests
        self.streams = []
        self.in_flight = 0

    def take(self):
        """One more request, while time and the request budget last."""
        if self.budget <= 0 or time.monotonic() >= self.deadline:
            return False
        self.budget -= 1
        return True


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", default=os.environ.get("TOKSTREAM_KEY"), help="default: $TOKSTREAM_KEY")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--pids", type=int, nargs="*", help="service PIDs whose RSS to report (default: found in /proc)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one request may take in all")
    parser.add_argument("--max-requests", type=int, default=100_000, help="a hard cap on requests sent")
    parser.add_argument("--check-prompts", type=int, default=len(PROMPTS), help="prompts to fetch a non-streamed reply for")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    refuse_bad(parser, args)
    return args


def refuse_bad(parser, args):
    url = urlparse(args.url)
    if url.scheme not in ("http", "https") or url.hostname not in LOOPBACK:
        parser.error(f"--url must be http(s) on 127.0.0.1, localhost or ::1; got {args.url!r}")
    if not args.key:
        parser.error("give --key or set TOKSTREAM_KEY (`manage.py create_api_key --name soak`)")
    if not (1 <= args.streams <= 512 and 0 < args.minutes <= 24 * 60 and args.max_tokens >= 1 and args.max_requests >= 1):
        parser.error("--streams must be 1-512, --minutes in (0, 1440], --max-tokens and --max-requests at least 1")


def command_line():
    """As run, with the interpreter; a --key value is masked, so the output can be shared."""
    argv = list(sys.orig_argv)
    for i, arg in enumerate(argv):
        if arg == "--key" and i + 1 < len(argv):
            argv[i + 1] = "***"
        elif arg.startswith("--key="):
            argv[i] = "--key=***"
    return shlex.join(argv)


def request_body(args, prompt, stream):
    body = {"model": args.model, "messages": [{"role": "user", "content": PROMPTS[prompt]}],
            "stream": stream, "temperature": 0, "max_tokens": args.max_tokens}  # fmt: skip
    if stream:
        # continuous usage: every content chunk carries the tokens so far, so a chunk that was
        # lost or sent twice shows in the counts even where the text alone could not tell.
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def http_client(args):
    # The read time-out only has to outlast the service's keep-alive comments (15 s).
    timeout = httpx.Timeout(connect=10, read=60, write=10, pool=10)
    headers = {"Authorization": f"Bearer {args.key}"}
    return httpx.AsyncClient(base_url=args.url, headers=headers, timeout=timeout, limits=httpx.Limits(max_connections=1))


# --- one stream --------------------------------------------------------------------------


def on_chunk(stream, chunk, now):
    if "error" in chunk:
        stream.error = chunk["error"].get("code") or chunk["error"].get("message") or "error"
        return
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            on_content(stream, content, chunk.get("usage"), now)
        stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
    if not chunk.get("choices") and chunk.get("usage"):
        stream.usage_tokens = chunk["usage"].get("completion_tokens")


def on_content(stream, content, usage, now):
    if stream.ttft is None:
        stream.ttft = now - stream.started
    else:
        stream.gaps.append(now - stream.last_chunk)
    stream.last_chunk = now
    stream.text += content
    tokens = (usage or {}).get("completion_tokens")
    if tokens is not None:
        stream.repeats += tokens <= stream.chunk_tokens
        stream.chunk_tokens = max(tokens, stream.chunk_tokens)


async def read_stream(response, stream):
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue  # ids, retry hints, keep-alive comments
        data = line[len("data: ") :]
        if data == "[DONE]":
            stream.done = True
            return
        on_chunk(stream, json.loads(data), time.monotonic())
    stream.broken = "closed without [DONE]"


async def refused(response, stream):
    """A non-200 answer: its error code, and how long to wait before the next request."""
    try:
        error = json.loads(await response.aread()).get("error") or {}
    except ValueError:
        error = {}
    stream.error = f"{response.status_code} {error.get('code') or error.get('type') or ''}".strip()
    retry_after = response.headers.get("retry-after", "")
    return float(retry_after) if retry_after.replace(".", "", 1).isdigit() else 1.0


async def send_stream(client, args, stream):
    """The request and its stream; returns seconds to back off before the next one."""
    async with client.stream("POST", "/v1/chat/completions", json=request_body(args, stream.prompt, True)) as response:
        stream.status = response.status_code
        stream.request_id = response.headers.get("x-request-id", "")
        if response.status_code != 200:
            return await refused(response, stream)
        await read_stream(response, stream)
    return 0.0


async def one_stream(client, args, prompt):
    stream = Stream(prompt, started=time.monotonic())
    backoff = 0.0
    try:
        # Bounded in all (not only per read), so a stalled stream cannot keep the run going.
        backoff = await asyncio.wait_for(send_stream(client, args, stream), args.timeout)
    except TimeoutError:
        stream.broken = f"no [DONE] within {args.timeout:g} s"
    except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError) as exc:
        # Besides the network: a data line that is not JSON, or a chunk of an unexpected shape;
        # either ends this stream, not the whole run.
        stage = "in the stream" if stream.status else "before the response"
        stream.broken = f"{type(exc).__name__} {stage}" + (f": {exc}"[:200] if str(exc) else "")
        # No answer at all (nothing listening, say): wait, rather than spin through the budget.
        backoff = 0.0 if stream.status else 1.0
    stream.ended = time.monotonic()
    return stream, backoff


async def client_loop(run, index):
    """Back to back until time is up; each loop starts at its own prompt."""
    async with http_client(run.args) as client:
        for n in range(index, index + run.args.max_requests):
            if not run.take():
                return
            run.in_flight += 1
            stream, backoff = await one_stream(client, run.args, n % len(PROMPTS))
            run.in_flight -= 1
            run.streams.append(stream)
            if backoff:
                await asyncio.sleep(min(backoff, max(0.0, run.deadline - time.monotonic())))


# --- service processes -------------------------------------------------------------------


def proc_read(pid, name):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def argv_of(pid):
    return [a.decode(errors="replace") for a in proc_read(pid, "cmdline").split(b"\0") if a]


def env_of(pid):
    """Which service a process belongs to: the Redis it uses and its key prefix."""
    pairs = (item.partition(b"=") for item in proc_read(pid, "environ").split(b"\0"))
    env = {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}
    return env.get("REDIS_URL"), env.get("TOKSTREAM_REDIS_PREFIX")


def option(argv, *names):
    for i, arg in enumerate(argv[:-1]):
        if arg in names:
            return argv[i + 1]
    return None


def role_of(argv, port):
    """'daphne' for a Daphne on `port`, 'worker' for any Celery worker, else None."""
    # A shell or `timeout` wrapping the command has it in its argv too, but is not the service.
    if not argv or not os.path.basename(argv[0]).startswith(("python", "daphne", "celery")):
        return None
    names = {os.path.basename(a) for a in argv}
    if "daphne" in names and (option(argv, "-p", "--port") or "8000") == str(port):
        return "daphne"
    if "celery" in names and "worker" in argv:
        return "worker"
    return None


def find_service(url):
    """{pid: role} of the Daphne on the URL's port, and the Celery workers sharing its Redis
    and prefix (other people's services on this machine are left out; with no Daphne found,
    no worker can be told apart, so none is reported)."""
    port = urlparse(url).port or (443 if url.startswith("https") else 80)
    found = {int(p): role_of(argv_of(p), port) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()}
    daphnes = {pid for pid, role in found.items() if role == "daphne"}
    envs = {env_of(pid) for pid in daphnes}
    workers = {pid for pid, role in found.items() if role == "worker" and env_of(pid) in envs}
    return {pid: found[pid] for pid in sorted(daphnes | workers)}


def rss_mb(pid):
    for line in proc_read(pid, "status").decode(errors="replace").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None  # gone


class RssWatch:
    """RSS of each process at the start, its peak while sampled, and at the end."""

    def __init__(self, processes):
        self.processes = processes
        self.start = {pid: rss_mb(pid) for pid in processes}
        self.peak = dict(self.start)
        self.end = {}

    def sample(self):
        for pid in self.processes:
            now = rss_mb(pid)
            if now is not None:
                self.peak[pid] = max(now, self.peak[pid] or 0)
        return self

    def finish(self):
        self.end = {pid: rss_mb(pid) for pid in self.processes}
        return self.sample()

    def rows(self):
        return [{"pid": pid, "role": role, "start_mb": self.start[pid], "peak_mb": self.peak[pid], "end_mb": self.end.get(pid)}
                for pid, role in self.processes.items()]  # fmt: skip


# --- the run -----------------------------------------------------------------------------


async def watch(run, rss):
    """A line a minute, so a long soak shows it is alive; RSS sampled every few seconds."""
    next_line = run.started + PROGRESS_SECONDS
    while True:
        await asyncio.sleep(5)
        rss.sample()
        if time.monotonic() >= next_line:
            next_line += PROGRESS_SECONDS
            print(f"  {time.monotonic() - run.started:6.0f} s: {len(run.streams)} requests done, {run.in_flight} in flight", flush=True)


async def load(args, rss):
    run = Run(args)
    watcher = asyncio.ensure_future(watch(run, rss))
    try:
        await asyncio.gather(*(client_loop(run, i) for i in range(args.streams)))
    finally:
        watcher.cancel()
    return run.streams, time.monotonic() - run.started


async def whole_reply(client, args, prompt):
    """The non-streamed greedy reply: (text, completion_tokens), or (None, why)."""
    try:
        response = await asyncio.wait_for(client.post("/v1/chat/completions", json=request_body(args, prompt, False)), args.timeout)
    except (TimeoutError, httpx.HTTPError) as exc:
        return None, type(exc).__name__
    if response.status_code != 200:
        return None, f"{response.status_code}"
    reply = response.json()
    return reply["choices"][0]["message"]["content"] or "", reply["usage"]["completion_tokens"]


async def references(args, streams):
    """One reply per prompt that had a finished stream, sequentially, so the service is idle."""
    prompts = sorted({s.prompt for s in streams if s.outcome in FINISHED})[: args.check_prompts]
    async with http_client(args) as client:
        return {p: await whole_reply(client, args, p) for p in prompts}


# --- the report --------------------------------------------------------------------------


def percentile(ordered, q):
    """Nearest rank, on an already sorted list."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latency_ms(values):
    ordered = sorted(values)
    return {f"p{q}": None if not ordered else round(percentile(ordered, q) * 1000, 1) for q in (50, 95, 99)} | {"n": len(ordered)}


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatch(stream, reference):
    at = first_difference(stream.text, reference)
    return {"prompt": stream.prompt, "outcome": stream.outcome, "at_char": at,
            "streamed": stream.text[max(0, at - 20) : at + 40], "expected": reference[max(0, at - 20) : at + 40]}  # fmt: skip


def text_check(streams, refs):
    """Finished streams must equal the reply; an unterminated one must be a prefix of it."""
    checked, mismatches, token_mismatches = 0, [], 0
    for stream in streams:
        text, tokens = refs.get(stream.prompt, (None, None))
        if text is None:
            continue
        if stream.outcome in FINISHED:
            checked += 1
            token_mismatches += stream.usage_tokens != tokens
            if stream.text != text:
                mismatches.append(mismatch(stream, text))
        elif stream.outcome == "unterminated" and not text.startswith(stream.text):
            mismatches.append(mismatch(stream, text))
    return {"streams_checked": checked, "prompts_checked": sum(t is not None for t, _ in refs.values()),
            "reference_failures": {p: why for p, (t, why) in refs.items() if t is None},
            "lost_or_duplicated": len(mismatches), "usage_differs_from_reference": token_mismatches,
            "examples": mismatches[:5]}  # fmt: skip


def token_check(streams):
    """Within each finished stream: content chunks' token counts only grow, and the final usage
    is the last chunk's count, or one more (a stop token has no text)."""
    finished = [s for s in streams if s.outcome in FINISHED]
    extra = [s.usage_tokens - s.chunk_tokens for s in finished if s.usage_tokens is not None]
    return {"chunks_not_growing": sum(s.repeats for s in finished), "usage_equal": extra.count(0),
            "usage_plus_one": extra.count(1), "usage_inconsistent": sum(e not in (0, 1) for e in extra),
            "no_usage": len(finished) - len(extra)}  # fmt: skip


def counts(streams):
    outcomes = {}
    for stream in streams:
        outcomes[stream.outcome] = outcomes.get(stream.outcome, 0) + 1
    return outcomes


def reasons(streams, outcome, attribute):
    found = {}
    for stream in streams:
        if stream.outcome == outcome:
            key = getattr(stream, attribute) or "?"
            found[key] = found.get(key, 0) + 1
    return found


def example(stream):
    return {"request_id": stream.request_id, "prompt": stream.prompt, "broken": stream.broken, "ttft_s": stream.ttft,
            "seconds": round(stream.ended - stream.started, 1), "tokens": stream.chunk_tokens}  # fmt: skip


def summarize(args, streams, seconds, refs, rss):
    tokens = sum(s.tokens for s in streams)
    return {
        "command": command_line(),
        "args": {k: v for k, v in vars(args).items() if k != "key"},
        "seconds": round(seconds, 1),
        "requests": len(streams),
        "outcomes": counts(streams),
        "errors": reasons(streams, "error", "error"),
        "rejected": reasons(streams, "rejected", "error"),
        "unterminated": reasons(streams, "unterminated", "broken"),
        "unterminated_examples": [example(s) for s in streams if s.outcome == "unterminated"][:5],
        "ttft_ms": latency_ms([s.ttft for s in streams if s.ttft is not None]),
        "inter_token_gap_ms": latency_ms([g for s in streams for g in s.gaps]),
        "completion_tokens": tokens,
        "tokens_per_second": round(tokens / seconds, 1) if seconds else None,
        "text_check": text_check(streams, refs),
        "token_check": token_check(streams),
        "rss": rss.rows(),
    }


def mb(value):
    return "gone" if value is None else f"{value:.0f} MB"


def print_summary(s):
    o = s["outcomes"]
    print(f"command: {s['command']}")
    print(f"{s['requests']} requests in {s['seconds']} s: completed (stop) {o.get('stop', 0)}, length {o.get('length', 0)}, "
          f"error {o.get('error', 0)}, unterminated {o.get('unterminated', 0)}, rejected {o.get('rejected', 0)}")  # fmt: skip
    others = {k: v for k, v in o.items() if k not in ("stop", "length", "error", "unterminated", "rejected")}
    for label, found in (("other endings", others), ("errors", s["errors"]), ("rejected", s["rejected"]), ("unterminated", s["unterminated"])):
        if found:
            print(f"  {label}: " + ", ".join(f"{k} x{v}" for k, v in found.items()))
    print_checks(s)
    for name in ("ttft_ms", "inter_token_gap_ms"):
        p = s[name]
        print(f"{name[:-3].replace('_', ' '):17s} p50 {p['p50']} ms  p95 {p['p95']} ms  p99 {p['p99']} ms  (n={p['n']})")
    print(f"tokens: {s['completion_tokens']} completion tokens, {s['tokens_per_second']} tokens/s overall")
    print_rss(s["rss"])


def print_checks(s):
    t = s["text_check"]
    print(f"lost or duplicated: {t['lost_or_duplicated']} streams (of {t['streams_checked']} finished, over {t['prompts_checked']} prompts "
          f"vs the non-streamed reply); usage differs from the reply's: {t['usage_differs_from_reference']}")  # fmt: skip
    for example in t["examples"]:
        print(f"  prompt {example['prompt']} ({example['outcome']}) at char {example['at_char']}: got {example['streamed']!r}, want {example['expected']!r}")
    if t["reference_failures"]:
        print(f"  no reference reply for prompts: {t['reference_failures']}")
    k = s["token_check"]
    print(f"token counts: content chunks not growing {k['chunks_not_growing']}; final usage vs the last chunk's count: "
          f"equal {k['usage_equal']}, +1 (stop token) {k['usage_plus_one']}, inconsistent {k['usage_inconsistent']}, missing {k['no_usage']}")  # fmt: skip


def print_rss(rows):
    for row in rows:
        print(f"RSS {row['role']:6s} pid {row['pid']:7d}: start {mb(row['start_mb'])}, peak {mb(row['peak_mb'])}, end {mb(row['end_mb'])}")
    if not rows:
        print("RSS: no service processes found (give --pids)")


def main():
    args = parse_args()
    processes = {pid: "given" for pid in args.pids} if args.pids else find_service(args.url)
    rss = RssWatch(processes)
    print(f"command: {command_line()}")
    print(
        f"{args.streams} streams for {args.minutes:g} min against {args.url}, {args.max_tokens} tokens each; watching {processes or 'no processes'}", flush=True
    )
    streams, seconds = asyncio.run(load(args, rss))
    rss.finish()  # before the checks: the memory the load left behind
    summary = summarize(args, streams, seconds, asyncio.run(references(args, streams)), rss)
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
