"""The fault suite: live processes on the shipped timing settings, real Redis, the test
database. Each test says what a user would notice."""

import time

import pytest

from billing.models import ApiKey, Budget, UsageEntry
from inference.gateway import limits
from tests.sse import MODEL


@pytest.fixture
def budgeted(transactional_db):
    """A key with a daily token budget large enough for every test here: its holds must all
    come back."""
    key, raw = ApiKey.issue("faults")
    budget = Budget.objects.create(api_key=key, period="day", token_limit=10_000_000)
    return key, raw, budget


def rows_for(request_ids, seconds, statuses=None):
    """Wait until every request has its ledger row; return {request id: [rows]}."""
    deadline = time.monotonic() + seconds
    while True:
        rows = {r: list(UsageEntry.objects.filter(request_id=r)) for r in request_ids}
        if all(rows.values()) or time.monotonic() > deadline:
            missing = [r for r, found in rows.items() if not found]
            assert not missing, f"{len(missing)} of {len(request_ids)} requests have no ledger row after {seconds} s"
            return rows
        time.sleep(0.5)


def holds_back(budget, seconds=30):
    """The budget's holds, once every request ended: all given back."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        budget.refresh_from_db()
        if budget.reserved_tokens == 0:
            return True
        time.sleep(0.5)
    return False


def queue_empty(client, model=MODEL):
    return client.zcard(limits.queue_key(model)) == 0
