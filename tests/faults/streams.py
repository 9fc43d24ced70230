"""A recording SSE client for the fault suite: what a user's program saw, and when."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from tests.sse import MODEL, auth, events


@dataclass
class Stream:
    status: int = 0
    events: list = field(default_factory=list)  # (event id or None, data)
    keepalives: int = 0
    keepalives_before_text: int = 0
    started: float = 0.0
    opened_at: float | None = None  # the first event: the request was admitted
    first_text_at: float | None = None
    ended_at: float | None = None
    failure: str = ""  # how the client's read failed, if it did

    @property
    def done(self):
        return bool(self.events) and self.events[-1][1] == "[DONE]"

    @property
    def chunks(self):
        return [data for _, data in self.events if isinstance(data, dict)]

    @property
    def request_id(self):
        return next((c["id"] for c in self.chunks if "id" in c), None)

    @property
    def text(self):
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices"))

    @property
    def queue_position(self):
        return next(c["tokstream"]["queue_position"] for c in self.chunks if "queue_position" in c.get("tokstream", {}))

    @property
    def error(self):
        return next((c["error"] for c in self.chunks if "error" in c), None)

    @property
    def usage(self):
        return next((c["usage"] for c in reversed(self.chunks) if c.get("usage")), None)

    @property
    def completion_seen(self):
        """The completion tokens the client was told of (continuous usage), 0 if none."""
        counts = [c["usage"]["completion_tokens"] for c in self.chunks if c.get("usage") and c.get("choices")]
        return max(counts, default=0)


def body(content, max_tokens=64, **extra):
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **extra,
    }


def record(url, key, payload, timeout=300, leave_after=None, read_delay=0.0, hold=None):
    """Stream one request. `leave_after`: seconds after the answer began that the client closes
    the connection; `read_delay`: seconds the client waits before reading each next event;
    `hold`: called with the stream once its first text arrived, and read on when it returns."""
    stream = Stream(started=time.monotonic())
    with httpx.Client(timeout=timeout) as client:
        try:
            with client.stream("POST", f"{url}/v1/chat/completions", json=payload, headers=auth(key)) as response:
                stream.status = response.status_code
                if leave_after is not None:  # a user closing the tab, whatever the server is sending
                    threading.Timer(leave_after, client.close).start()
                if response.status_code == 200:
                    read(response, stream, read_delay, hold)
        except (httpx.HTTPError, RuntimeError, OSError) as exc:  # RuntimeError: closed under it
            stream.failure = repr(exc)
    stream.ended_at = time.monotonic()
    return stream


def read(response, stream, read_delay, hold):
    def keepalive():
        stream.keepalives += 1
        stream.keepalives_before_text += stream.first_text_at is None

    for event in events(response, on_comment=keepalive):
        stream.events.append(event)
        stream.opened_at = stream.opened_at or time.monotonic()
        if stream.first_text_at is None and stream.text:
            stream.first_text_at = time.monotonic()
            if hold:
                hold(stream)
        if read_delay:
            time.sleep(read_delay)


def record_many(url, key, payloads, **options):
    with ThreadPoolExecutor(len(payloads)) as pool:
        return list(pool.map(lambda p: record(url, key, p, **options), payloads))


def whole(url, key, payload):
    """The same request, not streamed: its reply's text."""
    plain = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    response = httpx.post(f"{url}/v1/chat/completions", json=plain, headers=auth(key), timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")
