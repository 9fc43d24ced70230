"""Shared fixtures. The tests start the real processes they test; tests/settings.py gives them
a Redis database and key prefix of their own."""

import contextlib
import os

import pytest

from tests.service import LiveService
from tests.waiting import eventually

pytest_plugins = ["tests.browser", "tests.upstreams"]


@pytest.fixture(scope="session", autouse=True)
def redis_server():
    """The test session's own redis-server, unless TEST_REDIS_URL named one to use."""
    if os.environ.get("TOKSTREAM_TEST_OWN_REDIS") != "1":
        yield None
        return
    from django.conf import settings

    from tokstream_site import processes

    server = processes.start_redis(settings.REDIS_URL)
    yield server
    if server:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_client(redis_server):
    from inference import streamlog

    client = streamlog.sync_client()
    yield client
    prefix = os.environ["TOKSTREAM_REDIS_PREFIX"]
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="session")
def live_service(django_db_setup, django_db_blocker, redis_client):
    """Daphne and a Celery worker with the real model, on the test database, on free ports."""
    from django.db import connection

    service = LiveService(connection.settings_dict)
    service.start()
    yield service
    service.stop()
    with django_db_blocker.unblock():
        wait_for_other_sessions_to_close(connection)


@contextlib.contextmanager
def separate_service(django_db_blocker, redis_db, redis_url=None, **options):
    """A service of a test's own, on a Redis database of its own (so its Celery queue is its
    own too), or on the Redis at `redis_url`: for tests that kill a worker or need several
    processes."""
    from django.db import connection

    redis_url = redis_url or os.environ["TEST_REDIS_URL"].rsplit("/", 1)[0] + f"/{redis_db}"
    service = LiveService(connection.settings_dict, TEST_REDIS_URL=redis_url, **options)
    try:
        service.start()
        yield service
    finally:
        service.stop()
        with django_db_blocker.unblock():
            # Only this service's own: the session's live service still holds its sessions.
            wait_for_other_sessions_to_close(connection, service.application_name)


def wait_for_other_sessions_to_close(connection, application_name=None, seconds=10):
    """PostgreSQL ends a stopped process's sessions a moment later; the test database can only
    be dropped once they are gone. With `application_name`, only the sessions of that name."""
    if connection.vendor != "postgresql":
        return
    query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    if application_name:
        query += " AND application_name = %s"

    def closed():
        with connection.cursor() as cursor:
            cursor.execute(query, [application_name] if application_name else [])
            return cursor.fetchone()[0] == 0

    # Should they linger, dropping the database says so with PostgreSQL's own error.
    with contextlib.suppress(AssertionError):
        eventually(closed, seconds, interval=0.1, message="other sessions on the test database are still open")


@pytest.fixture
def api_key(transactional_db):
    from billing.models import ApiKey

    _, raw = ApiKey.issue("test")
    return raw


@pytest.fixture(scope="session")
def tokenizer():
    from inference import registry

    return registry.tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def model():
    from inference.worker import engines

    return engines.load("smollm2-135m-instruct")
