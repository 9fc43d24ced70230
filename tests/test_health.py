"""/healthz tells a load balancer whether this service can answer."""

import json
import os
import socket
import subprocess
import time

import httpx
import pytest
from django.conf import settings

from inference import streamlog
from inference.worker import beats as worker_beats
from tests.conftest import separate_service


@pytest.mark.django_db
def test_it_answers_503_when_no_worker_has_a_model(client, settings):
    settings.TOKSTREAM_REDIS_PREFIX = "tokstream-test-no-workers-here"
    response = client.get("/healthz")
    assert response.status_code == 503
    checks = response.json()["checks"]
    assert checks["workers"]["ok"] is False and checks["database"]["ok"] and checks["redis"]["ok"]


@pytest.mark.django_db
def test_it_answers_503_when_redis_is_down(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["checks"]["redis"]["ok"] is False


def upstream_only():
    """A model that needs no weights, so a worker serves it as soon as it starts."""
    return json.dumps({"vendor": {"source": "openai-compatible", "base_url": "http://127.0.0.1:9/v1", "upstream_model": "m", "tokenizer": "o200k_base"}})


def test_a_worker_that_stops_is_not_counted_for_the_rest_of_its_heartbeat(django_db_blocker):
    with separate_service(django_db_blocker, 7, TOKSTREAM_MODELS=upstream_only()) as service:
        worker = service.children[0]
        worker.terminate()  # a warm shutdown, as `manage.py serve` and process managers stop it
        stopped = time.monotonic()
        worker.wait(timeout=60)
        answer = httpx.get(f"{service.url}/healthz", timeout=10)
        assert answer.status_code == 503 and answer.json()["checks"]["workers"]["ok"] is False
        assert time.monotonic() - stopped < settings.TOKSTREAM_WORKER_TTL  # not its beat running out


def test_a_starting_worker_forgets_the_beats_of_this_hosts_dead_workers(redis_client):
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    host = socket.gethostname()
    beats = {
        f"{host}:{dead.pid}:0ld:cpu:m": "dead",
        f"{host}:{os.getpid()}:0ld:cpu:m": "a restarted container's worker before this one, with the same pid",
        f"{host}:{alive.pid}:0ld:cpu:m": "alive",
        f"{host}:{os.getpid()}:{worker_beats.BOOT}:cpu:m": "this process's own",
        f"elsewhere:{dead.pid}:0ld:cpu:m": "other host",
    }
    until = json.dumps({"model": "m", "until": time.time() + 60, "running": 0, "waiting": 0})
    redis_client.hset(streamlog.workers_key(), mapping={field: until for field in beats})
    try:
        forgotten = worker_beats.forget_stopped_here(redis_client)
        assert sorted(forgotten) == sorted([f"{host}:{dead.pid}:0ld:cpu:m", f"{host}:{os.getpid()}:0ld:cpu:m"])
        assert set(beats) - set(forgotten) <= set(streamlog.workers(redis_client))
    finally:
        alive.kill()
        redis_client.hdel(streamlog.workers_key(), *beats)
