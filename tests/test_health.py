"""/healthz tells a load balancer whether this service can answer."""

import pytest


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
