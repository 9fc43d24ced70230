"""The service's processes, as commands: used by `manage.py serve` and by the tests."""

import shutil
import subprocess
import sys
import time
from urllib.parse import urlparse

import redis


def daphne_command(host, port):
    return [sys.executable, "-m", "daphne", "-b", host, "-p", str(port), "tokstream_site.asgi:application"]


def worker_command(concurrency, hostname="inference@%h"):
    # The threads pool: one process, one model in memory, and each task a thread that streams
    # its request while the engine thread steps every running request.
    return [
        sys.executable, "-m", "celery", "-A", "tokstream_site", "worker",
        "-Q", "inference", "-P", "threads", "-c", str(concurrency), "-n", hostname, "--loglevel", "INFO",
    ]  # fmt: skip


def redis_answers(url):
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.RedisError:
        return False


def start_redis(url):
    """Start a local redis-server for `url` when none answers; returns the process or None."""
    if redis_answers(url):
        return None
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"Redis at REDIS_URL={url} does not answer, and it is not on this machine.")
    if shutil.which("redis-server") is None:
        raise SystemExit("Redis does not answer and redis-server is not installed: `apt-get install redis-server`.")
    command = ["redis-server", "--bind", parsed.hostname, "--port", str(parsed.port or 6379), "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    for _ in range(50):
        if redis_answers(url):
            return process
        time.sleep(0.1)
    raise SystemExit("redis-server did not start")
