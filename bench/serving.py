"""The service for a benchmark: its own database and Redis keys, then Daphne and the Celery
worker, once they answer /healthz."""

import functools
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx


def setup(name, redis_db):
    """A new SQLite database and Redis keys of the benchmark's own, then Django; -> a new
    folder for its files (the database, the service's log)."""
    folder = Path(tempfile.mkdtemp())
    os.environ.update(DATABASE_URL=f"sqlite:///{folder / 'bench.sqlite3'}", TOKSTREAM_REDIS_PREFIX=f"tokstream-{name}-{os.getpid()}")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tokstream_site.settings")
    os.environ["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", f"redis://127.0.0.1:6379/{redis_db}")
    import django

    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return folder


TOPICS = ["tea", "the sea", "volcanoes", "chess", "bread", "owls", "trains", "glass", "rivers", "clocks", "maps", "paper"]


def question(n):
    """The benchmarks' chat question `n`: a number of its own in every prompt, so no request
    finds its whole prompt cached."""
    return f"Question {n}: tell me about the history of {TOPICS[n % len(TOPICS)]} in a few paragraphs."


@functools.cache
def http():
    """One client for every request, as a program using the OpenAI SDK keeps one: a new
    httpx client builds its TLS context, about 40 ms that no reply should be charged."""
    return httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64))


def chunks(url, key, body):
    """POST /v1/chat/completions streamed; yields each chunk as it comes, parsed. A refusal or
    a failed stream ends the benchmark: its figures would lie."""
    with http().stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise SystemExit(f"the service answered {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise SystemExit(f"the service failed the stream: {chunk['error']}")
            yield chunk


def has_text(chunk):
    # The first chunk (the role, the queue position) comes at admission, before any token.
    return any(choice["delta"].get("content") for choice in chunk["choices"])


def start_service(root, port, log_path, env, concurrency=4):
    from tokstream_site import processes  # after django.setup() in the benchmark

    log = open(log_path, "w")
    children = [
        subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        for cmd in (processes.worker_command(concurrency, hostname=f"bench-{port}@%h"), processes.daphne_command("127.0.0.1", port))
    ]
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return children
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the service did not start; see {log_path}")
