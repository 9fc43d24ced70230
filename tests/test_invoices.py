"""Vendor usage exports: imported whole or refused whole, once, and reconciled with the ledger."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import CommandError, call_command

from billing import invoices, ledger
from billing.models import Invoice, InvoiceLine, PriceSheet, UsageEntry

pytestmark = pytest.mark.django_db
DAY = datetime(2026, 11, 2, 12, 0, tzinfo=UTC)
HEADER = "request_id,date,model,input_tokens,input_cached_tokens,output_tokens,cost\n"


def entry(request_id, prompt=100, cached=0, completion=20, model="gpt-4o", at=DAY):
    return ledger.record(request_id, "stop", model=model, tokenizer="o200k_base", prompt_tokens=prompt, cached_prompt_tokens=cached,
                         completion_tokens=completion, received_at=at, finished_at=at + timedelta(seconds=1))  # fmt: skip


def crafted():
    """One line that matches, one the ledger lacks, one 3 input tokens over; and an entry the
    vendor did not report."""
    entry("r-match")
    entry("r-differs")
    entry("r-unreported", at=DAY + timedelta(hours=3))
    entry("r-other-model", model="smollm2")  # not the vendor's: never missing from its invoice
    return crafted_lines()


def crafted_lines():
    return (HEADER + "r-match,2026-11-02,gpt-4o,100,0,20,\n" + "r-unknown,2026-11-02,gpt-4o,50,0,5,\n" + "r-differs,2026-11-02,gpt-4o,103,0,20,\n").encode()


def by_key(outcomes):
    return {o.key: o for o in outcomes}


def test_a_crafted_export_reconciles_into_exactly_its_four_outcomes():
    invoice, created = invoices.import_invoice("openai", "nov.csv", crafted())
    outcomes = by_key(invoices.reconcile(invoice))
    assert created and invoice.granularity == "request"
    assert {k: o.status for k, o in outcomes.items()} == {
        "r-match": "matched", "r-unknown": "missing_in_ledger", "r-differs": "differs", "r-unreported": "missing_in_invoice",
    }  # fmt: skip
    assert outcomes["r-differs"].differences == {"input_tokens": 3, "cached_input_tokens": 0, "output_tokens": 0}
    assert invoices.totals(outcomes.values())["input_tokens_difference"] == 3


def test_importing_the_same_file_twice_changes_nothing():
    data = crafted()
    first, _ = invoices.import_invoice("openai", "nov.csv", data)
    again, created = invoices.import_invoice("openai", "nov-copy.csv", data)
    assert again.pk == first.pk and not created
    assert Invoice.objects.count() == 1 and InvoiceLine.objects.count() == 3


def test_a_file_with_a_bad_line_is_refused_whole_with_its_number():
    data = (HEADER + "r-1,2026-11-02,gpt-4o,100,0,20,\n" + "r-2,2026-11-02,gpt-4o,lots,0,20,\n").encode()
    with pytest.raises(invoices.InvoiceError, match="line 3: input_tokens must be a whole number") as refused:
        invoices.import_invoice("openai", "bad.csv", data)
    assert refused.value.line == 3
    assert Invoice.objects.count() == 0 and InvoiceLine.objects.count() == 0


def test_a_header_without_the_vendor_s_columns_is_refused_at_line_1():
    with pytest.raises(invoices.InvoiceError, match="line 1: the header lacks the column"):
        invoices.import_invoice("openai", "bad.csv", b"id,prompt,completion\nx,1,2\n")


def test_a_difference_becomes_an_adjustment_and_then_matches():
    invoice, _ = invoices.import_invoice("openai", "nov.csv", crafted())
    adjustment = invoices.adjust_to_invoice(invoice, "r-differs")
    assert adjustment.kind == "adjustment" and adjustment.prompt_tokens == 3 and "line 4" in adjustment.error
    assert by_key(invoices.reconcile(invoice))["r-differs"].status == "matched"
    with pytest.raises(invoices.InvoiceError, match="not a differing"):  # a second click writes nothing
        invoices.adjust_to_invoice(invoice, "r-differs")
    assert UsageEntry.objects.filter(kind="adjustment").count() == 1
    assert ledger.verify()[1] is None  # the chain still holds


def test_costs_are_compared_within_the_vendor_s_tolerance():
    PriceSheet.objects.create(model="gpt-4o", input_per_million=Decimal("2.5"), cached_input_per_million=Decimal("1.25"),
                              output_per_million=Decimal("10"), effective_from=DAY - timedelta(days=30))  # fmt: skip
    ours = entry("r-priced").total_cost  # 100 * 2.5e-6 + 20 * 10e-6 = 0.00045
    close = HEADER + f"r-priced,2026-11-02,gpt-4o,100,0,20,{ours + Decimal('0.0000005')}\n"
    invoice, _ = invoices.import_invoice("openai", "close.csv", close.encode())
    assert by_key(invoices.reconcile(invoice))["r-priced"].status == "matched"
    far = HEADER + f"r-priced,2026-11-02,gpt-4o,100,0,20,{ours + Decimal('0.01')}\n"
    invoice, _ = invoices.import_invoice("openai", "far.csv", far.encode())
    outcome = by_key(invoices.reconcile(invoice))["r-priced"]
    assert outcome.status == "differs" and outcome.differences["cost"] == Decimal("0.01")


def test_daily_buckets_are_compared_with_the_ledger_s_sums_per_day_and_model():
    entry("r-a", prompt=100, completion=10)
    entry("r-b", prompt=50, completion=5)
    entry("r-c", prompt=7, completion=1, at=DAY + timedelta(days=1))
    data = b"date,model,input_tokens,input_cached_tokens,output_tokens\n2026-11-02,gpt-4o,150,0,15\n2026-11-03,gpt-4o,9,0,1\n"
    invoice, _ = invoices.import_invoice("openai", "daily.csv", data)
    outcomes = by_key(invoices.reconcile(invoice))
    assert invoice.granularity == "day"
    assert outcomes["2026-11-02 gpt-4o"].status == "matched"
    assert outcomes["2026-11-03 gpt-4o"].differences["input_tokens"] == 2


def test_the_command_imports_reports_and_refuses_with_the_line_number(tmp_path, capsys):
    path = tmp_path / "nov.csv"
    path.write_bytes(crafted())
    call_command("import_invoice", str(path), "--vendor", "openai", "--report", str(tmp_path / "report.csv"))
    out = capsys.readouterr().out
    assert "imported" in out and "differs: 1" in out and "missing_in_ledger: 1" in out
    report = (tmp_path / "report.csv").read_text().splitlines()
    assert report[0].startswith("status,key,line") and len(report) == 5
    bad = tmp_path / "bad.csv"
    bad.write_bytes((HEADER + "r-1,2026-11-02,gpt-4o,1,0,1,\n,2026-11-02,gpt-4o,1,0,1,\n").encode())
    with pytest.raises(CommandError, match="line 3: no request_id; nothing was imported"):
        call_command("import_invoice", str(bad), "--vendor", "openai")
    assert UsageEntry.objects.filter(kind="adjustment").count() == 0


def test_staff_upload_an_export_review_it_and_adjust_a_line_in_the_admin(admin_client):
    crafted()
    upload = SimpleUploadedFile("nov.csv", crafted_lines(), content_type="text/csv")
    response = admin_client.post("/admin/billing/invoice/upload/", {"vendor": "openai", "file": upload}, follow=True)
    page = response.content.decode()
    assert response.status_code == 200 and 'class="differs"' in page and 'class="missing_in_invoice"' in page
    invoice = Invoice.objects.get()
    export = admin_client.get(f"/admin/billing/invoice/{invoice.pk}/reconciliation/?format=csv")
    assert export["Content-Type"] == "text/csv" and b"differs,r-differs,4" in export.content
    admin_client.post(f"/admin/billing/invoice/{invoice.pk}/reconciliation/", {"key": "r-differs"})
    assert UsageEntry.objects.get(kind="adjustment").prompt_tokens == 3
    bad = SimpleUploadedFile("bad.csv", (HEADER + "r-1,2026-11-02,gpt-4o,x,0,1,\n").encode(), content_type="text/csv")
    refused = admin_client.post("/admin/billing/invoice/upload/", {"vendor": "openai", "file": bad})
    assert "line 2: input_tokens must be a whole number" in refused.content.decode() and Invoice.objects.count() == 1


def test_a_file_naming_a_request_twice_is_refused_at_the_second_line():
    data = (HEADER + "r-1,2026-11-02,gpt-4o,1,0,1,\n" + "r-2,2026-11-02,gpt-4o,1,0,1,\n" + "r-1,2026-11-02,gpt-4o,1,0,1,\n").encode()
    with pytest.raises(invoices.InvoiceError, match="line 4: the same request as line 2"):
        invoices.import_invoice("openai", "twice.csv", data)


def test_a_relayed_request_is_matched_by_the_vendor_s_id_and_model():
    ledger.record("chatcmpl-ours", "stop", model="our-alias", model_served="gpt-4o", vendor_request_id="chatcmpl-vendor-7", tokenizer="o200k_base",
                  prompt_tokens=10, completion_tokens=2, received_at=DAY, finished_at=DAY + timedelta(seconds=1))  # fmt: skip
    data = (HEADER + "chatcmpl-vendor-7,2026-11-02,gpt-4o,10,0,2,\n").encode()
    invoice, _ = invoices.import_invoice("openai", "relayed.csv", data)
    assert [(o.status, o.key) for o in invoices.reconcile(invoice)] == [("matched", "chatcmpl-vendor-7")]


def test_a_report_never_carries_a_formula():
    invoice, _ = invoices.import_invoice("openai", "f.csv", (HEADER + "=HYPERLINK(1),2026-11-02,gpt-4o,1,0,1,\n").encode())
    rows = list(invoices.report_rows(invoices.reconcile(invoice)))
    assert rows[1][1] == "'=HYPERLINK(1)"
