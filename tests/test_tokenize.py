"""POST /v1/tokenize: a chat request's exact prompt tokens and estimated cost, without running it."""

from datetime import timedelta
from decimal import Decimal

import httpx
import pytest
from django.utils import timezone

from billing.models import PriceSheet, UsageEntry
from tests.sse import MODEL, auth, chat_body

pytestmark = pytest.mark.django_db(transaction=True)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tokenize(live_service, api_key, body, status=200):
    response = httpx.post(f"{live_service.url}/v1/tokenize", json=body, headers=auth(api_key), timeout=30)
    assert response.status_code == status, response.text
    return response.json()


def test_it_agrees_with_the_ledger_for_the_same_request(live_service, api_key, redis_client):
    body = chat_body("Name three rivers.", max_tokens=4, temperature=0, tools=TOOLS)
    counted = tokenize(live_service, api_key, body)
    assert UsageEntry.objects.count() == 0  # counting runs nothing
    answer = httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=60).json()
    entry = UsageEntry.objects.get(request_id=answer["id"])
    assert counted["prompt_tokens"] == entry.prompt_tokens == answer["usage"]["prompt_tokens"]
    assert counted["tokenizer"] == entry.tokenizer and counted["max_tokens"] == 4


def test_it_estimates_the_cost_at_the_price_sheet_in_force(live_service, api_key):
    PriceSheet.objects.create(
        model=MODEL, input_per_million=Decimal("2"), cached_input_per_million=Decimal("1"), output_per_million=Decimal("8"),
        effective_from=timezone.now() - timedelta(hours=1),
    )  # fmt: skip
    counted = tokenize(live_service, api_key, chat_body("Hello there.", max_tokens=100, n=2))
    prompt = Decimal(counted["prompt_tokens"]) * 2 / 1_000_000
    assert Decimal(counted["estimated_cost"]["prompt"]) == prompt
    assert Decimal(counted["estimated_cost"]["at_most"]) == prompt + Decimal(200) * 8 / 1_000_000
    assert counted["estimated_cost"]["currency"] == "USD"


def test_without_a_price_sheet_the_cost_is_unknown_not_zero(live_service, api_key):
    assert tokenize(live_service, api_key, chat_body("Hello there."))["estimated_cost"] is None


def test_it_refuses_what_the_chat_endpoint_refuses(live_service, api_key):
    error = tokenize(live_service, api_key, chat_body("hi", model="no-such-model"), status=404)["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    error = tokenize(live_service, api_key, {**chat_body("hi"), "max_tokens": 10**7}, status=400)["error"]
    assert error["param"] == "max_tokens"
    response = httpx.post(f"{live_service.url}/v1/tokenize", json=chat_body("hi"), timeout=30)
    assert response.status_code == 401
