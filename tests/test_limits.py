"""Admission control: per-key rates and a bounded queue answer 429 with Retry-After, and a
refused request leaves nothing queued."""

import os
import time

import httpx
import pytest

from billing.models import ApiKey
from inference import streamlog
from tests.sse import MODEL, auth, chat_body, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)


def request_keys(redis_client):
    """The keys of every request, and who stands in the model's queue."""
    keys = set(redis_client.scan_iter(match=f"{os.environ['TOKSTREAM_REDIS_PREFIX']}:req:*"))
    return keys, set(redis_client.zrange(streamlog.queue_key(MODEL), 0, -1))


def post(service, key, body):
    return httpx.post(f"{service.url}/v1/chat/completions", json=body, headers=auth(key), timeout=120)


def limited_key(**limits):
    if time.time() % 60 > 50:  # the window is the minute: do not let it turn mid-test
        time.sleep(61 - time.time() % 60)
    key, raw = ApiKey.issue("limited")
    ApiKey.objects.filter(pk=key.pk).update(**limits)
    return raw


def assert_refused(response, code, type):
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (code, type)


def test_requests_per_minute_are_limited(live_service, redis_client):
    key = limited_key(requests_per_minute=2)
    body = chat_body("Hi", max_tokens=2)
    assert [post(live_service, key, body).status_code for _ in range(2)] == [200, 200]
    before = request_keys(redis_client)
    assert_refused(post(live_service, key, body), "rate_limit_exceeded", "requests")
    assert request_keys(redis_client) == before  # nothing was queued for it


def test_tokens_per_minute_count_the_prompt_and_the_completion_budget(live_service, redis_client):
    key = limited_key(tokens_per_minute=100)
    assert post(live_service, key, chat_body("Hi", max_tokens=10)).status_code == 200
    before = request_keys(redis_client)
    assert_refused(post(live_service, key, chat_body("Hi", max_tokens=90)), "rate_limit_exceeded", "tokens")
    assert request_keys(redis_client) == before


@pytest.fixture
def waiting(redis_client, settings):
    """Requests that stand in the model's queue ahead of the test's own."""
    queue = streamlog.queue_key(MODEL)

    def fill(count):
        redis_client.zadd(queue, {f"chatcmpl-ahead-{n}": time.time() - 10 for n in range(count)})

    yield fill
    redis_client.zremrangebyscore(queue, 0, time.time() - 5)


def test_a_full_queue_refuses_at_once(live_service, api_key, waiting, redis_client, settings):
    waiting(settings.TOKSTREAM_MAX_QUEUED)
    before = request_keys(redis_client)
    assert_refused(post(live_service, api_key, chat_body("Hi", max_tokens=2)), "server_overloaded", "server_error")
    assert request_keys(redis_client) == before


def test_a_queued_stream_opens_with_its_place_in_the_queue(live_service, api_key, waiting):
    waiting(3)
    streamed = stream_chat(live_service, api_key, chat_body("Hi", max_tokens=2, stream=True))
    opening = streamed[0][1]
    assert opening["tokstream"] == {"queue_position": 3}
    assert opening["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
