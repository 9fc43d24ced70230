"""The fault suite: live processes on the shipped timing settings, real Redis, the test
database. Each test says what a user would notice."""

import pytest

from billing.models import ApiKey, Budget, UsageEntry
from inference import streamlog
from tests.sse import MODEL
from tests.waiting import eventually


@pytest.fixture
def budgeted(transactional_db):
    """A key with a daily token budget large enough for every test here: its holds must all
    come back."""
    key, raw = ApiKey.issue("faults")
    budget = Budget.objects.create(api_key=key, period="day", token_limit=10_000_000)
    return key, raw, budget


def rows_for(request_ids, seconds):
    """Wait until every request has its ledger row; return {request id: [rows]}."""

    def rows():
        return {r: list(UsageEntry.objects.filter(request_id=r)) for r in request_ids}

    def every_row():
        found = rows()
        return found if all(found.values()) else None

    def missing():
        return f"{sum(not found for found in rows().values())} of {len(request_ids)} requests have no ledger row"

    return eventually(every_row, seconds, interval=0.5, message=missing)


def holds_back(budget, seconds=30):
    """The budget's holds, once every request ended: all given back."""

    def given_back():
        budget.refresh_from_db()
        return budget.held_tokens == 0

    return eventually(given_back, seconds, interval=0.5, message=lambda: f"the budget still holds {budget.held_tokens} tokens")


def queue_empty(client, model=MODEL):
    return client.zcard(streamlog.queue_key(model)) == 0
