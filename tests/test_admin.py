"""Staff review the ledger in the Django admin: read-only, with totals, CSV and a usage chart."""

import csv
import io
import re
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.contrib.auth.models import Permission
from django.utils import timezone

from billing import export, ledger
from billing.models import ApiKey, PriceSheet, UsageEntry

pytestmark = pytest.mark.django_db(transaction=True)
CHANGELIST = "/admin/billing/usageentry/"
ENTRIES = "/api/ledger/entries/"


def body(response):
    return b"".join(response.streaming_content).decode()


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
    assert "3 entries: 30 prompt + 3 completion tokens." in page and "Cost: unknown" in page
    assert "3 entries have no price (30 prompt + 3 completion tokens)" in page
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
    rows = list(csv.DictReader(io.StringIO(body(response))))
    assert [int(r["id"]) for r in rows] == chosen and rows[0]["entry_hash"]


def test_the_csv_action_writes_no_formula_and_keeps_negative_counts(admin_client):
    now = ledger.as_datetime(time.time())
    entry = ledger.record(
        "r-admin-formula", "stop", model="m", tokenizer="t", prompt_tokens=10, completion_tokens=3,
        vendor_request_id="=cmd|' /C calc'!A0", received_at=now, finished_at=now,
    )  # fmt: skip
    reversal = ledger.reverse(entry, "-2+3+cmd|' /C calc'!A0")
    response = admin_client.post(CHANGELIST, {"action": "export_csv", "_selected_action": [entry.pk, reversal.pk]})
    usage, reversed_ = csv.DictReader(io.StringIO(body(response)))
    assert usage["vendor_request_id"] == "'=cmd|' /C calc'!A0" and reversed_["error"] == "'-2+3+cmd|' /C calc'!A0"
    assert (reversed_["prompt_tokens"], reversed_["completion_tokens"]) == ("-10", "-3")  # numbers stay numbers


def test_the_csv_action_and_the_rest_export_write_the_same_file(admin_client):
    prices = dict(input_per_million=Decimal(1), cached_input_per_million=Decimal(1), output_per_million=Decimal(2))
    PriceSheet.objects.create(model="m", effective_from=ledger.as_datetime(0), **prices)
    key, _ = ApiKey.issue("auditor")
    now = time.time()
    entry = ledger.record(
        "r-admin-same", "stop", api_key_id=key.pk, model="m", tokenizer="t", prompt_tokens=10, completion_tokens=3, vendor_request_id="=x",
        received_at=ledger.as_datetime(now), first_token_at=ledger.as_datetime(now + 0.5), finished_at=ledger.as_datetime(now + 1),
    )  # fmt: skip
    reversal = ledger.reverse(entry, "@staff reason")
    from_admin = body(admin_client.post(CHANGELIST, {"action": "export_csv", "_selected_action": [entry.pk, reversal.pk]}))
    from_rest = body(admin_client.get(ENTRIES, {"format": "csv"}))  # a staff session reads all
    assert from_admin == from_rest  # the same header, the same rows, cell for cell
    header, usage, reversed_ = csv.reader(io.StringIO(from_admin))
    assert header == export.COLUMNS and {"api_key", "corrects", "price_sheet", "entry_hash", "first_token_after_start_ms", "tokens_per_second"} <= set(header)
    usage, reversed_ = dict(zip(header, usage)), dict(zip(header, reversed_))
    assert (usage["api_key"], usage["price_sheet"], usage["vendor_request_id"], usage["duration_ms"]) == (
        str(key.pk),
        str(entry.price_sheet_id),
        "'=x",
        "1000",
    )
    assert (reversed_["corrects"], reversed_["error"], reversed_["total_cost"]) == (str(entry.pk), "'@staff reason", "-0.000016000")


def timed_entry(request_id, model="m"):
    """Queued 1.25 s, its first token 0.4 s after the start, 7 tokens in the 3 s after it."""
    now = time.time()
    return ledger.record(
        request_id, "stop", model=model, tokenizer="t", prompt_tokens=10, completion_tokens=7,
        received_at=ledger.as_datetime(now), started_at=ledger.as_datetime(now + 1.25),
        first_token_at=ledger.as_datetime(now + 1.65), finished_at=ledger.as_datetime(now + 4.65),
    )  # fmt: skip


def test_the_csv_gives_times_in_milliseconds_with_the_queue_apart_rounded_as_the_admin_shows_them(admin_client):
    entry = timed_entry("r-admin-timed")
    [row] = csv.DictReader(io.StringIO(body(admin_client.get(f"{CHANGELIST}export/"))))
    assert (row["queued_ms"], row["first_token_after_start_ms"], row["duration_ms"], row["tokens_per_second"]) == ("1250", "400", "4650", "2.3")
    page = " ".join(admin_client.get(f"{CHANGELIST}{entry.pk}/change/").content.decode().split())
    for label, shown in (("Queued for", "1,250 ms"), ("Time to first token (from the start)", "400 ms"), ("Duration", "4,650 ms")):
        assert re.search(rf"{re.escape(label)}:</label> <div class=\"readonly\">{shown}</div>", page), label
    assert "2.3 (after the first token)" in page


def test_the_export_link_streams_every_entry_the_filter_selects_not_only_the_page(admin_client):
    entries(130, "a")
    entries(5, "b")
    page = admin_client.get(CHANGELIST, {"model": "a"})
    assert page.context["cl"].result_count == 130 and len(page.context["cl"].result_list) == 100  # the list shows a page
    link = re.search(r'id="export-filtered" href="([^"]+)">Export 130 entries as CSV<', page.content.decode()).group(1)
    response = admin_client.get(link.replace("&amp;", "&"))
    assert response.streaming and response["Content-Type"] == "text/csv"
    rows = list(csv.DictReader(io.StringIO(body(response))))
    assert len(rows) == 130 and {r["model"] for r in rows} == {"a"}


def test_the_export_needs_the_right_to_view_the_ledger(client, django_user_model):
    entries(1)
    client.force_login(django_user_model.objects.create_user("clerk", password="x", is_staff=True))
    assert client.get(f"{CHANGELIST}export/").status_code == 403


def test_the_usage_chart_draws_the_rest_daily_totals(admin_client):
    prices = dict(input_per_million=Decimal(1), cached_input_per_million=Decimal(1), output_per_million=Decimal(2))
    PriceSheet.objects.create(model="a", effective_from=ledger.as_datetime(0), **prices)
    entries(3, "a")
    entries(2, "b")
    context = admin_client.get(f"{CHANGELIST}usage/").context
    daily = admin_client.get("/api/ledger/daily/").json()
    assert [(row["model"], row["currency"]) for row in daily] == [("a", "USD"), ("b", "")]
    charts = dict(context["cost_charts"])
    assert list(charts) == ["USD"] and context["unpriced"]["entries"] == 2  # b has no price: in no cost chart, and said so
    for row in daily:
        assert f"<title>{row['model']} {row['day']}: {row['total_tokens']:g}</title>" in context["tokens_chart"]
    assert f"<title>a {daily[0]['day']}: {float(daily[0]['cost']):g}</title>" in charts["USD"] and "<title>b " not in charts["USD"]


def test_finance_sees_money_totalled_per_currency_with_the_unpriced_counted_and_a_chart_per_currency(new_page, live_service, django_user_model):
    """Entries in two currencies and some unpriced, in the browser: a total per currency (never
    one sum) to its minor unit, the unpriced counted beside them, and a cost chart per currency."""
    prices = dict(input_per_million=Decimal(1000), cached_input_per_million=Decimal(1000), output_per_million=Decimal(2000))
    PriceSheet.objects.create(model="usd", effective_from=ledger.as_datetime(0), currency="USD", **prices)
    PriceSheet.objects.create(model="eur", effective_from=ledger.as_datetime(0), currency="EUR", **prices)
    entries(2, "usd")  # 10 prompt + 0 or 1 completion each: 0.010 + 0.012 USD
    entries(1, "eur")  # 0.010 EUR
    entries(3, "free")
    today = timezone.now().date().isoformat()
    finance = django_user_model.objects.create_user("staff", password="pw-for-tests-only", is_staff=True)
    finance.user_permissions.add(Permission.objects.get(codename="view_usageentry"))  # a reviewer: read, never write
    page = sign_in(new_page, live_service, "staff")
    page.wait_for_selector(".cost-chart svg")
    assert [chart.get_attribute("data-currency") for chart in page.locator(".cost-chart").all()] == ["EUR", "USD"]
    for currency, model, cost in (("EUR", "eur", "0.01"), ("USD", "usd", "0.022")):
        chart = page.locator(f".cost-chart[data-currency={currency}] svg")
        assert chart.locator("text").first.text_content() == f"Cost per day ({currency})"
        bars = chart.locator("rect title").all_text_contents()
        assert [bar for bar in bars if not bar.endswith(": 0")] == [f"{model} {today}: {cost}"]  # one series: its own currency's models
        assert chart.locator("text.tick").all_text_contents()[0] == "0" and len(chart.locator("text.tick").all()) > 2  # a y-axis
    assert page.text_content("#usage-unpriced").startswith("3 entries have no price (30 prompt + 3 completion tokens)")
    page.goto(f"{live_service.url}{CHANGELIST}")
    assert " ".join(page.text_content("#ledger-totals p").split()) == "6 entries: 60 prompt + 4 completion tokens."
    assert page.locator("#ledger-costs .cost").all_text_contents() == ["0.01 EUR (1 entry)", "0.02 USD (2 entries)"]
    unpriced = " ".join(page.text_content("#ledger-unpriced").split())
    assert unpriced == "3 entries have no price (30 prompt + 3 completion tokens): not in the cost above."  # the free ones: 0 + 1 + 2 completion


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
    assert labels[0] == "Tokens per day" and labels[-2:] == ["■ a", "■ b"]
    assert page.locator("#tokens-chart svg text.tick").all_text_contents() == ["0", "25", "50", "75", "100"]  # a y-axis, up to 54 and over
    dates = labels[6:-2]
    assert len(dates) == 10 and dates[-1] == today[5:]  # 30 days, every third labelled, so none overlap; the last is today
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
    page = admin_client.get(CHANGELIST).content.decode()
    shown = {request_id: cell(page, request_id, "vendor_check") for request_id in ("r-agree", "r-differ", "r-estimate", "r-admin-m-0")}
    assert shown == {"r-agree": "agree", "r-differ": "differ", "r-estimate": "not compared", "r-admin-m-0": "—"}
    assert "Not compared" in page  # the filter's choice


def cell(page, request_id, column):
    """The text of one column in the changelist row of `request_id`."""
    row = next(row for row in page.split("<tr")[1:] if f">{request_id}<" in row)
    found = re.search(rf'<td class="field-{column}">(.*?)</td>', row, re.S)
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


def test_an_entry_s_page_shows_its_times_to_the_millisecond_with_its_durations(admin_client):
    received = datetime(2026, 12, 1, 10, 0, 0, 123000, tzinfo=UTC)
    at = {name: received + timedelta(milliseconds=ms) for name, ms in (("started_at", 50), ("first_token_at", 312), ("finished_at", 2312))}
    entry = ledger.record("r-times", "stop", model="m", tokenizer="t", prompt_tokens=5, completion_tokens=41, received_at=received, **at)
    page = " ".join(admin_client.get(f"{CHANGELIST}{entry.pk}/change/").content.decode().split())
    assert "2026-12-01 10:00:00.123 UTC" in page and "2026-12-01 10:00:02.435 UTC" in page
    assert "50 ms" in page and "262 ms" in page and "2,312 ms" in page  # the first token 262 ms after the start
    assert "20.5 (after the first token)" in page  # 41 tokens in the 2 s after the first
