"""Budgets: admission holds each request's worst case, so concurrent requests cannot pass one."""

from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import pytest
from django.utils import timezone

from billing import budgets
from billing.models import ApiKey, Budget, PriceSheet, UsageEntry
from tests.sse import MODEL, auth, chat_body
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)


def budgeted_key(**limits):
    key, raw = ApiKey.issue("budgeted")
    return key, raw, Budget.objects.create(api_key=key, period="day", **limits)


def post(service, raw, max_tokens):
    body = chat_body("Hi", max_tokens=max_tokens, logit_bias={"0": -100, "1": -100, "2": -100})
    return httpx.post(f"{service.url}/v1/chat/completions", json=body, headers=auth(raw), timeout=120)


def settled(budget, key, admitted):
    """Once every admitted request has its entry and gave its hold back."""

    def done():
        budget.refresh_from_db()
        return UsageEntry.objects.filter(api_key=key).count() == admitted and budget.held_tokens == 0 and budget

    return eventually(done, 30, interval=0.1, message="the holds were not given back")


def test_fifty_concurrent_requests_against_a_budget_for_ten_admit_at_most_ten(live_service, tokenizer):
    per_request = len(tokenizer.apply_chat_template(chat_body("Hi")["messages"], add_generation_prompt=True)) + 1
    key, raw, budget = budgeted_key(token_limit=10 * per_request)
    with ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(lambda _: post(live_service, raw, 1), range(50)))
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == 10 and statuses.count(429) == 40
    refusal = next(a for a in answers if a.status_code == 429).json()["error"]
    assert refusal["code"] == refusal["type"] == "insufficient_quota"
    budget = settled(budget, key, 10)
    assert budget.spent(timezone.now()) == (10 * per_request, Decimal(0))
    assert post(live_service, raw, 1).status_code == 429  # spent is spent


def test_a_money_budget_counts_the_worst_case_at_current_prices(live_service):
    prices = dict(input_per_million=Decimal(1000), cached_input_per_million=Decimal(500), output_per_million=Decimal(2000))
    PriceSheet.objects.create(model=MODEL, effective_from=timezone.now(), **prices)
    key, raw, budget = budgeted_key(money_limit=Decimal("0.2"))
    assert post(live_service, raw, 10).status_code == 200  # about 0.05 at most
    settled(budget, key, 1)
    entry = UsageEntry.objects.get(api_key=key)
    assert entry.total_cost > 0 and entry.price_sheet is not None
    assert post(live_service, raw, 100).status_code == 429  # 0.2 more could pass the limit


@pytest.mark.parametrize("period, word", [("day", "daily"), ("month", "monthly")])
def test_a_refusal_names_its_period_in_a_word(period, word):
    key, _ = ApiKey.issue("worded")
    budget = Budget.objects.create(api_key=key, period=period, token_limit=5, money_limit=Decimal("0.01"))
    with pytest.raises(budgets.OverBudget, match=f"the {word} budget of 5 has 5 left"):
        budgets.check(budget, 10, Decimal(0), timezone.now())
    with pytest.raises(budgets.OverBudget, match=f"the {word} budget of 0.01 does not"):
        budgets.check(budget, 1, Decimal(1), timezone.now())
