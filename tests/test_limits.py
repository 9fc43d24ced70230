"""Admission control: per-key rates and a bounded queue answer 429 with Retry-After, and a
refused request leaves nothing queued."""

import os
import time

import httpx
import pytest

from billing.models import ApiKey
from inference import streamlog
from inference.gateway import limits
from inference.gateway.admission import Owner
from inference.protocol.errors import ApiError
from tests.sse import MODEL, auth, chat_body, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)
MINUTE = 60 * 1_000_000  # a minute in 1971: the tests that bring their own clock start on its first second


def request_keys(redis_client):
    """The keys of every request, and who stands in the model's queue."""
    keys = set(redis_client.scan_iter(match=f"{os.environ['TOKSTREAM_REDIS_PREFIX']}:req:*"))
    return keys, set(redis_client.zrange(streamlog.queue_key(MODEL), 0, -1))


def post(service, key, body):
    return httpx.post(f"{service.url}/v1/chat/completions", json=body, headers=auth(key), timeout=120)


def limited_key(**limits):
    key, raw = ApiKey.issue("limited")
    ApiKey.objects.filter(pk=key.pk).update(**limits)
    return raw


def limited_owner(**limits):
    key, _ = ApiKey.issue("limited here")
    ApiKey.objects.filter(pk=key.pk).update(**limits)
    return Owner.of_key(ApiKey.objects.get(pk=key.pk))


def refusal(client, owner, tokens, now):
    with pytest.raises(ApiError) as refused:
        limits.check_rate(client, owner, tokens, now=now)
    return refused.value


def assert_refused(response, code, type):
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (code, type)


def test_requests_are_counted_per_minute_and_the_next_minute_starts_afresh(redis_client):
    owner = limited_owner(requests_per_minute=2)
    limits.check_rate(redis_client, owner, 1, now=MINUTE + 5)
    limits.check_rate(redis_client, owner, 1, now=MINUTE + 40)
    refused = refusal(redis_client, owner, 1, now=MINUTE + 45)
    assert (refused.status, refused.code, refused.type) == (429, "rate_limit_exceeded", "requests")
    assert refused.headers == {"Retry-After": "15"}  # the rest of the minute
    limits.check_rate(redis_client, owner, 1, now=MINUTE + 60)


def test_tokens_are_counted_per_minute_and_a_refusal_counts_nothing(redis_client):
    owner = limited_owner(tokens_per_minute=100)
    limits.check_rate(redis_client, owner, 60, now=MINUTE)
    refused = refusal(redis_client, owner, 41, now=MINUTE + 59.5)
    assert (refused.code, refused.type, refused.headers) == ("rate_limit_exceeded", "tokens", {"Retry-After": "1"})
    limits.check_rate(redis_client, owner, 40, now=MINUTE + 59.5)
    limits.check_rate(redis_client, owner, 100, now=MINUTE + 60)


# Against the live service, whichever minute it is: a limit no request fits, or one met exactly.
def test_a_request_over_its_rate_is_refused_and_leaves_nothing_queued(live_service, redis_client):
    key = limited_key(requests_per_minute=0)
    before = request_keys(redis_client)
    assert_refused(post(live_service, key, chat_body("Hi", max_tokens=2)), "rate_limit_exceeded", "requests")
    assert request_keys(redis_client) == before  # nothing was queued for it


def test_tokens_per_minute_count_the_prompt_and_the_completion_budget(live_service, redis_client, tokenizer):
    prompt = len(tokenizer.apply_chat_template(chat_body("Hi")["messages"], add_generation_prompt=True))
    key = limited_key(tokens_per_minute=prompt + 10)
    before = request_keys(redis_client)
    assert_refused(post(live_service, key, chat_body("Hi", max_tokens=11)), "rate_limit_exceeded", "tokens")
    assert request_keys(redis_client) == before
    assert post(live_service, key, chat_body("Hi", max_tokens=10)).status_code == 200  # exactly the limit


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
