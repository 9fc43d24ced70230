import csv
from datetime import timedelta

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Count, Sum
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone
from django.utils.safestring import mark_safe

from billing import charts, export, invoices, ledger, money
from billing.models import ApiKey, Budget, Invoice, PriceSheet, UsageEntry

# Whether a vendor's counts agree with ours; an entry with none to compare says so, never "agree".
VENDOR_CHECK = {True: "differ", False: "agree", None: "not compared"}
RELAYED_SOURCES = ("upstream", "estimate", "upstream_counted")  # the last: entries written before the vendor's usage was the bill


def moment(field, description):
    """An admin column of one of an entry's times, to the millisecond."""
    return admin.display(description=description)(lambda self, entry: to_the_millisecond(getattr(entry, field)))


def to_the_millisecond(at):
    if at is None:
        return "—"
    local = timezone.localtime(at)
    return local.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + local.strftime(" %Z")


def shown_ms(value):
    return "—" if value is None else f"{value:,} ms"


class CountsDifferFilter(admin.BooleanFieldListFilter):
    """Yes, no, and "not compared" (a local model, or an upstream that reported no usage)."""

    def choices(self, changelist):
        for choice in super().choices(changelist):
            if choice["display"] == "Unknown":
                choice["display"] = "Not compared"
            yield choice


@admin.register(UsageEntry)
class UsageEntryAdmin(admin.ModelAdmin):
    list_display = [
        "request_id", "received_at", "model", "status", "prompt_tokens", "completion_tokens", "total_cost", "currency", "usage_source", "vendor_check",
        "api_key", "user",
    ]  # fmt: skip
    list_filter = ["status", ("counts_differ", CountsDifferFilter), "usage_source", "model", "received_at", "api_key", "user"]
    search_fields = ["request_id"]
    date_hierarchy = "received_at"
    list_select_related = ["api_key", "user"]
    actions = ["export_csv", "reverse_entries"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    fieldsets = [
        (None, {"fields": ["request_id", "kind", "corrects", "model", "model_served", "tokenizer", "status", "finish_reason", "error", "api_key", "user"]}),
        ("Tokens", {"fields": ["prompt_tokens", "cached_prompt_tokens", "steering_tokens", "completion_tokens", "usage_source"]}),
        ("Vendor", {"fields": [
            "vendor_check", "vendor_request_id", "vendor_prompt_tokens", "vendor_cached_prompt_tokens", "vendor_completion_tokens",
            "counted_prompt_tokens", "counted_completion_tokens",
        ]}),
        ("Timing", {"fields": ["received", "started", "first_token", "finished", "queued", "time_to_first_token_shown", "duration", "tokens_per_second_shown"]}),
        ("Cost", {"fields": ["price_sheet", "input_cost", "cached_input_cost", "output_cost", "total_cost", "currency"]}),
        ("Chain", {"fields": ["previous_hash", "entry_hash"]}),
    ]  # fmt: skip
    readonly_fields = [
        "vendor_check", "received", "started", "first_token", "finished", "queued", "time_to_first_token_shown", "duration",
        "tokens_per_second_shown", "previous_hash", "entry_hash",
    ]  # fmt: skip

    @admin.display(description="vendor counts", ordering="counts_differ")
    def vendor_check(self, entry):
        if entry.usage_source not in RELAYED_SOURCES:
            return "—"  # a local model's counts are its ids: no vendor to compare with
        return VENDOR_CHECK[entry.counts_differ]

    received = moment("received_at", "received")
    started = moment("started_at", "started")
    first_token = moment("first_token_at", "first token")
    finished = moment("finished_at", "finished")

    @admin.display(description="queued for")
    def queued(self, entry):
        return shown_ms(entry.queued_ms)

    @admin.display(description="time to first token (from the start)")
    def time_to_first_token_shown(self, entry):
        return shown_ms(entry.first_token_after_start_ms)

    @admin.display(description="duration")
    def duration(self, entry):
        return shown_ms(entry.duration_ms)

    @admin.display(description="tokens per second")
    def tokens_per_second_shown(self, entry):
        rate = entry.tokens_per_second
        return "—" if rate is None else f"{rate:.1f} (after the first token)"

    def changelist_view(self, request, extra_context=None):
        """The list, with the totals of the rows its filters select."""
        response = super().changelist_view(request, extra_context)
        changelist = getattr(response, "context_data", {}).get("cl")
        if changelist is not None:
            response.context_data["totals"] = totals(changelist.queryset)
        return response

    @admin.action(description="Export the selected entries as CSV")
    def export_csv(self, request, queryset):
        # The REST export's columns and cells, so the two files agree line for line.
        return export.csv_response(queryset)

    def export_view(self, request):
        """Every entry the list's filters, search and dates select, not only its page."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        return export.csv_response(self.get_changelist_instance(request).get_queryset(request))

    @admin.action(description="Reverse the selected entries (new reversal entries)")
    def reverse_entries(self, request, queryset):
        for entry in queryset.filter(kind=UsageEntry.Kind.USAGE):
            try:
                ledger.reverse(entry, f"reversed by {request.user.get_username()} in the admin")
            except ledger.CorrectionError as exc:
                messages.warning(request, str(exc))

    def get_urls(self):
        usage = path("usage/", self.admin_site.admin_view(self.usage_view), name="billing_usageentry_usage")
        csv_file = path("export/", self.admin_site.admin_view(self.export_view), name="billing_usageentry_export")
        return [usage, csv_file, *super().get_urls()]

    def usage_view(self, request):
        """Tokens and cost per day and model, over the chosen days (30 by default)."""
        days = chosen_days(request)
        since = timezone.now() - timedelta(days=days)
        entries = UsageEntry.objects.filter(received_at__gte=since)
        rows = list(ledger.daily_totals(entries))
        labels = [(since + timedelta(days=i + 1)).date().isoformat() for i in range(days)]
        currencies = sorted({row["currency"] for row in rows if row["cost"] is not None})
        context = {
            **self.admin_site.each_context(request),
            "title": "Usage per day",
            "days": days,
            "tokens_chart": mark_safe(charts.stacked_bars(labels, per_day(rows, labels, "total_tokens"), "Tokens per day")),
            # One chart per currency: amounts in two currencies do not stack.
            "cost_charts": [(c, mark_safe(charts.stacked_bars(labels, per_day(rows, labels, "cost", c), f"Cost per day ({c})"))) for c in currencies],
            "unpriced": totals(entries)["unpriced"],
        }
        return TemplateResponse(request, "admin/billing/usage.html", context)


def chosen_days(request):
    value = request.GET.get("days", "30")
    return min(max(int(value), 1), 366) if value.isdigit() else 30


def totals(queryset):
    """Entries and tokens of the selected rows; their cost per currency (never one sum across
    currencies); and what has no price, so a total is never read as complete when it is not."""
    counts = {"entries": Count("id"), "prompt_tokens": Sum("prompt_tokens"), "completion_tokens": Sum("completion_tokens")}
    priced = queryset.filter(total_cost__isnull=False).order_by("currency").values("currency").annotate(entries=Count("id"), cost=Sum("total_cost"))
    return {
        **queryset.aggregate(**counts),
        "costs": [{"amount": money.amount(row["cost"], row["currency"]), "entries": row["entries"]} for row in priced],
        "unpriced": queryset.filter(total_cost__isnull=True).aggregate(**counts),
    }


def per_day(rows, labels, field, currency=None):
    """{model: [value per label day]}, of one currency's rows when one is named (unpriced rows
    draw in no cost chart)."""
    series = {}
    for row in rows:
        if currency is not None and (row["currency"] != currency or row["cost"] is None):
            continue
        values = series.setdefault(row["model"], [0.0] * len(labels))
        day = row["day"].isoformat()
        if day in labels:
            values[labels.index(day)] += float(row[field] or 0)
    return series


@admin.register(PriceSheet)
class PriceSheetAdmin(admin.ModelAdmin):
    """Sheets are added, never edited: a new price is a new sheet with its own effective time."""

    list_display = ["model", "effective_from", "input_per_million", "cached_input_per_million", "output_per_million", "currency"]
    list_filter = ["model"]

    def has_change_permission(self, request, obj=None):
        return obj is None  # the add form only

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["__str__", "token_limit", "money_limit", "held_tokens", "held_money"]
    list_filter = ["period"]
    readonly_fields = ["held_tokens", "held_money"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "user", "created_at", "revoked_at"]
    readonly_fields = ["prefix", "created_at"]
    search_fields = ["name", "prefix"]

    def save_model(self, request, obj, form, change):
        if change:
            return super().save_model(request, obj, form, change)
        raw = obj.new_secret()
        super().save_model(request, obj, form, change)
        messages.warning(request, f"The new key is {raw} — copy it now, it is not shown again.")


class InvoiceUploadForm(forms.Form):
    vendor = forms.ChoiceField(choices=[])
    file = forms.FileField(help_text="The vendor's usage export, as CSV.")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["vendor"].choices = [(name, name) for name in sorted(settings.TOKSTREAM_VENDORS)]


@admin.register(Invoice)
class InvoiceAdmin(admin.ModelAdmin):
    """Imported vendor exports; each opens on its reconciliation with the ledger."""

    list_display = ["file_name", "vendor", "granularity", "imported_at", "imported_by", "line_count"]
    list_filter = ["vendor", "granularity"]
    change_list_template = "admin/billing/invoice/change_list.html"

    @admin.display(description="lines")
    def line_count(self, invoice):
        return invoice.lines.count()

    def has_add_permission(self, request):
        return False  # imports come through the upload form, whole or not at all

    def has_change_permission(self, request, obj=None):
        return False

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("upload/", view(self.upload_view), name="billing_invoice_upload"),
            path("<int:invoice_id>/reconciliation/", view(self.reconciliation_view), name="billing_invoice_reconciliation"),
            *super().get_urls(),
        ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        return redirect("admin:billing_invoice_reconciliation", invoice_id=object_id)

    def upload_view(self, request):
        if not request.user.has_perm("billing.add_invoice"):
            raise PermissionDenied
        form = InvoiceUploadForm(request.POST or None, request.FILES or None)
        if request.method == "POST" and form.is_valid():
            upload = form.cleaned_data["file"]
            try:
                invoice, created = invoices.import_invoice(form.cleaned_data["vendor"], upload.name, upload.read(), request.user)
            except invoices.InvoiceError as exc:
                form.add_error("file", f"{exc}. Nothing was imported.")
            else:
                self.message_user(request, "Imported." if created else "This file was imported before: nothing changed.")
                return redirect("admin:billing_invoice_reconciliation", invoice_id=invoice.pk)
        context = {**self.admin_site.each_context(request), "title": "Import a vendor usage export", "form": form}
        return TemplateResponse(request, "admin/billing/invoice/upload.html", context)

    def reconciliation_view(self, request, invoice_id):
        invoice = get_object_or_404(Invoice, pk=invoice_id)
        if not self.has_view_permission(request, invoice):
            raise PermissionDenied
        if request.method == "POST":
            return self.adjust(request, invoice)
        outcomes = invoices.reconcile(invoice)
        if request.GET.get("format") == "csv":
            return reconciliation_csv(invoice, outcomes)
        context = {
            **self.admin_site.each_context(request),
            "title": f"Reconciliation of {invoice}",
            "invoice": invoice,
            "outcomes": outcomes,
            "totals": sorted(invoices.totals(outcomes).items()),
            "can_adjust": request.user.has_perm("billing.add_usageentry"),
        }
        return TemplateResponse(request, "admin/billing/invoice/reconciliation.html", context)

    def adjust(self, request, invoice):
        """One action: the ledger takes the vendor's counts for one differing line."""
        if not request.user.has_perm("billing.add_usageentry"):
            raise PermissionDenied
        key = request.POST.get("key", "")
        try:
            adjustment = invoices.adjust_to_invoice(invoice, key)
        except (invoices.InvoiceError, ledger.CorrectionError) as exc:
            self.message_user(request, str(exc), messages.ERROR)
        else:
            self.message_user(request, f"Adjustment {adjustment.request_id} written for {key}.")
        return redirect("admin:billing_invoice_reconciliation", invoice_id=invoice.pk)


def reconciliation_csv(invoice, outcomes):
    response = HttpResponse(content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="reconciliation-{invoice.pk}.csv"'
    csv.writer(response).writerows(invoices.report_rows(outcomes))
    return response
