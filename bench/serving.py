"""Start the service's Daphne and Celery worker for a benchmark, once it answers /healthz."""

import functools
import subprocess
import time

import httpx


@functools.cache
def http():
    """One client for every request, as a program using the OpenAI SDK keeps one: a new
    httpx client builds its TLS context, about 40 ms that no reply should be charged."""
    return httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64))


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
