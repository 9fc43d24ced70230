"""Shared fixtures. Tests use their own Redis database number and key prefix, so they never
touch what a running `make run` keeps in Redis, and start the real processes they test."""

import os
import time
import uuid
from urllib.parse import urlparse

# Before Django reads its settings: the same Redis server as the service, another database.
TEST_REDIS_DB = 15
_redis = urlparse(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
os.environ["REDIS_URL"] = os.environ.get("TEST_REDIS_URL", _redis._replace(path=f"/{TEST_REDIS_DB}").geturl())
os.environ["TOKSTREAM_REDIS_PREFIX"] = f"tokstream-test-{uuid.uuid4().hex[:8]}"
os.environ.setdefault("TOKSTREAM_KEEPALIVE_SECONDS", "2")

import pytest  # noqa: E402

from tests.service import LiveService  # noqa: E402


@pytest.fixture(scope="session")
def redis_client():
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


def wait_for_other_sessions_to_close(connection, seconds=10):
    """PostgreSQL ends a stopped process's sessions a moment later; the test database can only
    be dropped once they are gone."""
    if connection.vendor != "postgresql":
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            if cursor.fetchone()[0] == 0:
                return
        time.sleep(0.1)


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
    from inference import registry

    return registry.load("smollm2-135m-instruct")
