"""The ledger: priced with the sheet in force, chained by hashes, written once per request."""

import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.management import CommandError, call_command
from django.db import (
    DatabaseError,
    IntegrityError,
    connection,
    connections,
    transaction,
)
from django.db.models import Sum
from django.utils import timezone

from billing import ledger
from billing.models import AppendOnlyError, PriceSheet, UsageEntry

pytestmark = pytest.mark.django_db(transaction=True)


def entry(request_id, **fields):
    now = time.time()
    values = dict(
        model="m",
        tokenizer="t",
        prompt_tokens=1000,
        cached_prompt_tokens=400,
        completion_tokens=200,
        received_at=ledger.as_datetime(now),
        finished_at=ledger.as_datetime(now + 1),
    )
    return ledger.record(request_id, "stop", **{**values, **fields})


def sheet(minutes_ago, input, cached, output):
    prices = dict(input_per_million=Decimal(input), cached_input_per_million=Decimal(cached), output_per_million=Decimal(output))
    return PriceSheet.objects.create(model="m", effective_from=timezone.now() - timedelta(minutes=minutes_ago), **prices)


def test_an_entry_without_a_price_sheet_has_an_unknown_cost_not_zero():
    assert entry("r-unpriced").total_cost is None
    assert UsageEntry.objects.get(request_id="r-unpriced").total_cost is None


def test_a_new_price_sheet_prices_new_entries_and_leaves_old_ones_alone():
    sheet(60, "2.50", "1.25", "10")
    old = entry("r-old")
    assert (old.input_cost, old.cached_input_cost, old.output_cost) == (Decimal("0.0015"), Decimal("0.0005"), Decimal("0.002"))
    assert old.total_cost == Decimal("0.004") and old.currency == "USD"
    sheet(0, "5", "2.5", "20")
    new = entry("r-new")
    assert new.total_cost == Decimal("0.008")
    assert UsageEntry.objects.get(request_id="r-old").total_cost == Decimal("0.004")  # as it was billed
    with pytest.raises(AppendOnlyError):
        PriceSheet.objects.first().save()


def test_verify_ledger_passes_untouched_and_names_an_edited_entry(capsys):
    for n in range(3):
        entry(f"r-chain-{n}")
    call_command("verify_ledger")
    assert "ledger verified: 3 entries" in capsys.readouterr().out
    edited = UsageEntry.objects.get(request_id="r-chain-1")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():  # the database refuses
        with connection.cursor() as cursor:
            cursor.execute("UPDATE billing_usageentry SET completion_tokens = 1 WHERE id = %s", [edited.pk])
    tamper("UPDATE billing_usageentry SET completion_tokens = 1 WHERE id = %s", [edited.pk])
    with pytest.raises(CommandError, match="r-chain-1"):
        call_command("verify_ledger")


def tamper(sql, params):
    """What someone who can switch the database's guard off might do."""
    trigger = "billing_usageentry_append_only"
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"ALTER TABLE billing_usageentry DISABLE TRIGGER {trigger}")
            cursor.execute(sql, params)
            cursor.execute(f"ALTER TABLE billing_usageentry ENABLE TRIGGER {trigger}")
        else:  # SQLite: drop the trigger, edit, put it back
            cursor.execute("SELECT sql FROM sqlite_master WHERE name = %s", [trigger])
            [definition] = cursor.fetchone()
            cursor.execute(f"DROP TRIGGER {trigger}")
            cursor.execute(sql, params)
            cursor.execute(definition)


def test_two_writers_racing_for_one_request_make_one_entry():
    results, start = [], threading.Barrier(2)

    def write():
        start.wait()
        try:
            results.append(entry("r-race").pk)
        finally:
            connections.close_all()

    writers = [threading.Thread(target=write) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert UsageEntry.objects.filter(request_id="r-race").count() == 1
    assert len(results) == 2 and len(set(results)) == 1
    assert ledger.verify()[1] is None


def test_a_reversal_nets_an_entry_out_of_every_total_and_keeps_the_chain():
    sheet(60, "2.50", "1.25", "10")
    original = entry("r-reversed")
    reversal = ledger.reverse(original, "billed twice by mistake")
    assert (reversal.kind, reversal.corrects, reversal.prompt_tokens, reversal.total_cost) == ("reversal", original, -1000, Decimal("-0.004"))
    totals = UsageEntry.objects.aggregate(tokens=Sum("prompt_tokens"), cost=Sum("total_cost"))
    assert totals == {"tokens": 0, "cost": Decimal(0)}
    with pytest.raises(ledger.CorrectionError):
        ledger.reverse(original, "again")
    adjustment = ledger.adjust(original, "the vendor counted 12 more", prompt_tokens=12)
    assert adjustment.kind == "adjustment" and UsageEntry.objects.aggregate(t=Sum("prompt_tokens"))["t"] == 12
    with pytest.raises(ledger.CorrectionError):
        ledger.adjust(original, "nonsense", colour=1)
    assert ledger.verify() == (3, None)


def test_daily_totals_sum_each_day_and_model_and_net_out_reversals():
    sheet(60 * 24 * 365 * 30, "2.50", "1.25", "10")  # in force on the fixed days below
    first, second = datetime(2024, 3, 1, 12, tzinfo=UTC), datetime(2024, 3, 2, 12, tzinfo=UTC)
    entry("r-day-1", received_at=first, finished_at=first)
    entry("r-day-2", received_at=second, finished_at=second)
    ledger.reverse(entry("r-day-3", received_at=second, finished_at=second), "billed twice")
    entry("r-day-unpriced", model="other", received_at=second, finished_at=second)
    rows = [
        (row["day"].isoformat(), row["model"], row["requests"], row["prompt_tokens"], row["completion_tokens"], row["total_tokens"], row["cost"])
        for row in ledger.daily_totals(UsageEntry.objects.all())
    ]
    assert rows == [
        ("2024-03-01", "m", 1, 1000, 200, 1200, Decimal("0.004")),
        ("2024-03-02", "m", 3, 1000, 200, 1200, Decimal("0.004")),  # two entries and the reversal of one
        ("2024-03-02", "other", 1, 1000, 200, 1200, None),  # unpriced: unknown, not zero
    ]


def test_the_database_refuses_a_usage_entry_with_negative_counts():
    with pytest.raises(IntegrityError):
        entry("r-negative", prompt_tokens=-1)


def test_it_writes_one_entry_per_request_however_often_it_is_recorded():
    first = entry("chatcmpl-1", completion_tokens=7)
    again = entry("chatcmpl-1", completion_tokens=99)
    assert again.pk == first.pk
    assert UsageEntry.objects.get().completion_tokens == 7


@pytest.mark.parametrize("reason,status", [("stop", "completed"), ("length", "length"), ("cancelled", "cancelled"), ("error", "failed")])
def test_the_status_follows_the_finish_reason(reason, status):
    now = ledger.as_datetime(time.time())
    recorded = ledger.record(f"chatcmpl-{reason}", reason, model="m", tokenizer="t", prompt_tokens=11, completion_tokens=7, received_at=now, finished_at=now)
    assert recorded.status == status


def test_entries_are_never_changed_or_deleted():
    recorded = entry("chatcmpl-1", completion_tokens=7)
    recorded.completion_tokens = 1
    with pytest.raises(AppendOnlyError):
        recorded.save()
    with pytest.raises(AppendOnlyError):
        recorded.delete()
    assert UsageEntry.objects.get().completion_tokens == 7
