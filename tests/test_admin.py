"""Staff review the ledger in the Django admin: read-only, with totals, CSV and a usage chart."""

import csv
import io
import time
from decimal import Decimal

import pytest
from django.utils import timezone

from billing import export, ledger
from billing.models import ApiKey, PriceSheet, UsageEntry

pytestmark = pytest.mark.django_db(transaction=True)
CHANGELIST = "/admin/billing/usageentry/"
ENTRIES = "/api/ledger/entries/"


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


def test_an_entry_s_page_has_nothing_to_submit(admin_client):
    entries(1)
    entry = UsageEntry.objects.get()
    assert entry.request_id in admin_client.get(CHANGELIST).content.decode()
    change_url = f"{CHANGELIST}{entry.pk}/change/"
    assert 'type="submit"' not in admin_client.get(change_url).content.decode().split('id="content"')[1]
    assert admin_client.get(f"{CHANGELIST}{entry.pk}/delete/").status_code == 403
    assert UsageEntry.objects.get().completion_tokens == 0


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


def test_the_csv_action_and_the_rest_export_write_the_same_file(admin_client):
    prices = dict(input_per_million=Decimal(1), cached_input_per_million=Decimal(1), output_per_million=Decimal(2))
    PriceSheet.objects.create(model="m", effective_from=ledger.as_datetime(0), **prices)
    key, _ = ApiKey.issue("auditor")
    now = time.time()
    entry = ledger.record(
        "r-admin-same", "stop", api_key=key, model="m", tokenizer="t", prompt_tokens=10, completion_tokens=3, vendor_request_id="=x",
        received_at=ledger.as_datetime(now), first_token_at=ledger.as_datetime(now + 0.5), finished_at=ledger.as_datetime(now + 1),
    )  # fmt: skip
    reversal = ledger.reverse(entry, "@staff reason")
    from_admin = admin_client.post(CHANGELIST, {"action": "export_csv", "_selected_action": [entry.pk, reversal.pk]}).content.decode()
    from_rest = b"".join(admin_client.get(ENTRIES, {"format": "csv"}).streaming_content).decode()  # a staff session reads all
    assert from_admin == from_rest  # the same header, the same rows, cell for cell
    header, usage, reversed_ = csv.reader(io.StringIO(from_admin))
    assert header == export.COLUMNS and {"api_key", "corrects", "price_sheet", "entry_hash", "time_to_first_token", "tokens_per_second"} <= set(header)
    usage, reversed_ = dict(zip(header, usage)), dict(zip(header, reversed_))
    assert (usage["api_key"], usage["price_sheet"], usage["vendor_request_id"], usage["time_to_first_token"]) == (
        str(key.pk),
        str(entry.price_sheet_id),
        "'=x",
        "0.5",
    )
    assert (reversed_["corrects"], reversed_["error"], reversed_["total_cost"]) == (str(entry.pk), "'@staff reason", "-0.000016000")


def test_the_usage_chart_draws_the_rest_daily_totals(admin_client):
    prices = dict(input_per_million=Decimal(1), cached_input_per_million=Decimal(1), output_per_million=Decimal(2))
    PriceSheet.objects.create(model="a", effective_from=ledger.as_datetime(0), **prices)
    entries(3, "a")
    entries(2, "b")
    context = admin_client.get(f"{CHANGELIST}usage/").context
    daily = admin_client.get("/api/ledger/daily/").json()
    assert [row["model"] for row in daily] == ["a", "b"]
    for row in daily:
        assert f"<title>{row['model']} {row['day']}: {row['total_tokens']:g}</title>" in context["tokens_chart"]
        assert f"<title>{row['model']} {row['day']}: {float(row['cost'] or 0):g}</title>" in context["cost_chart"]  # unknown draws as 0


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


def relayed(request_id, vendor=None, counted=(10, 5)):
    """A relayed request's entry: billed as the vendor reported, or our count as an estimate."""
    billed = vendor or counted
    reported = {"vendor_prompt_tokens": vendor[0], "vendor_completion_tokens": vendor[1]} if vendor else {}
    now = ledger.as_datetime(time.time())
    return ledger.record(
        request_id, "stop", model="up", tokenizer="t", prompt_tokens=billed[0], completion_tokens=billed[1], received_at=now, finished_at=now,
        usage_source="upstream" if vendor else "estimate", counted_prompt_tokens=counted[0], counted_completion_tokens=counted[1], **reported,
    )  # fmt: skip


def test_the_list_tells_agreeing_differing_and_uncompared_counts_apart(admin_client):
    agree, differ, estimate = relayed("r-agree", vendor=(10, 5)), relayed("r-differ", vendor=(12, 5)), relayed("r-estimate")
    assert (agree.counts_differ, differ.counts_differ, estimate.counts_differ) == (False, True, None)
    entries(1)  # a local model: nothing to compare either
    assert UsageEntry.objects.get(model="m").counts_differ is None

    def listed(**filters):
        page = admin_client.get(CHANGELIST, filters).content.decode()
        return {request_id for request_id in ("r-agree", "r-differ", "r-estimate", "r-admin-m-0") if request_id in page}

    assert listed(counts_differ__exact="1") == {"r-differ"} and listed(counts_differ__exact="0") == {"r-agree"}
    assert listed(counts_differ__isnull="True") == {"r-estimate", "r-admin-m-0"}
    page = " ".join(admin_client.get(CHANGELIST).content.decode().split())
    assert "Not compared" in page and all(word in page for word in ("agree", "differ", "not compared", "estimate"))
