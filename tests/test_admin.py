"""Staff review the ledger in the Django admin: read-only, with totals, CSV and a usage chart."""

import csv
import io
import time

import pytest
from django.utils import timezone

from billing import ledger
from billing.models import UsageEntry

pytestmark = pytest.mark.django_db(transaction=True)
CHANGELIST = "/admin/billing/usageentry/"


def entries(count, model="m"):
    now = time.time()
    for n in range(count):
        ledger.record(
            f"r-admin-{model}-{n}",
            "stop",
            model=model,
            tokenizer="t",
            prompt_tokens=10,
            completion_tokens=n,
            received_at=ledger.as_datetime(now),
            finished_at=ledger.as_datetime(now),
        )


def test_the_list_totals_the_filtered_rows_and_refuses_changes(admin_client):
    entries(3, "a")
    entries(2, "b")
    page = " ".join(admin_client.get(CHANGELIST, {"model": "a"}).content.decode().split())
    assert "3 entries: 30 prompt + 3 completion tokens; cost unknown" in page
    entry = UsageEntry.objects.first()
    assert admin_client.get(f"{CHANGELIST}add/").status_code == 403
    assert admin_client.post(f"{CHANGELIST}{entry.pk}/delete/").status_code == 403
    assert admin_client.post(f"{CHANGELIST}{entry.pk}/change/", {"prompt_tokens": 1}).status_code == 403


def test_the_csv_action_exports_the_selected_rows(admin_client):
    entries(4)
    chosen = list(UsageEntry.objects.order_by("id").values_list("pk", flat=True)[:2])
    response = admin_client.post(CHANGELIST, {"action": "export_csv", "_selected_action": chosen})
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [int(r["id"]) for r in rows] == chosen and rows[0]["entry_hash"]


def test_the_csv_action_writes_no_formula_and_keeps_negative_counts(admin_client):
    now = ledger.as_datetime(time.time())
    entry = ledger.record(
        "r-admin-formula", "stop", model="m", tokenizer="t", prompt_tokens=10, completion_tokens=3,
        vendor_request_id="=cmd|' /C calc'!A0", received_at=now, finished_at=now,
    )  # fmt: skip
    reversal = ledger.reverse(entry, "-2+3+cmd|' /C calc'!A0")
    response = admin_client.post(CHANGELIST, {"action": "export_csv", "_selected_action": [entry.pk, reversal.pk]})
    usage, reversed_ = csv.DictReader(io.StringIO(response.content.decode()))
    assert usage["vendor_request_id"] == "'=cmd|' /C calc'!A0" and reversed_["error"] == "'-2+3+cmd|' /C calc'!A0"
    assert (reversed_["prompt_tokens"], reversed_["completion_tokens"]) == ("-10", "-3")  # numbers stay numbers


def sign_in(new_page, service, username):
    page = new_page()
    page.goto(f"{service.url}/admin/login/?next=/admin/billing/usageentry/usage/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", "pw-for-tests-only")
    page.click("input[type=submit]")
    return page


def test_the_usage_chart_shows_staff_each_model_s_tokens_per_day_and_no_one_else(new_page, live_service, django_user_model):
    entries(3, "a")  # 3 × 10 prompt + 0 + 1 + 2 completion: 33 tokens
    entries(2, "b")  # 2 × 10 prompt + 0 + 1 completion: 21 tokens
    today = timezone.now().date().isoformat()
    django_user_model.objects.create_user("staff", password="pw-for-tests-only", is_staff=True)
    django_user_model.objects.create_user("plain", password="pw-for-tests-only")
    page = sign_in(new_page, live_service, "staff")
    page.wait_for_selector("#tokens-chart svg")
    # Each bar's tooltip names its model, day and tokens; every other day of the 30 is empty.
    bars = page.locator("#tokens-chart svg rect title").all_text_contents()
    assert len(bars) == 2 * 30
    assert [bar for bar in bars if not bar.endswith(": 0")] == [f"a {today}: 33", f"b {today}: 21"]
    labels = page.locator("#tokens-chart svg text").all_text_contents()
    assert labels[0] == "Tokens per day (max 54)" and labels[-2:] == ["■ a", "■ b"]
    assert labels[-3] == today[5:]  # the last day on the axis is today
    other = sign_in(new_page, live_service, "plain")
    assert other.locator("#tokens-chart").count() == 0 and "/admin/login/" in other.url
