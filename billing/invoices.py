"""Vendor usage exports: import a CSV whole or not at all, and reconcile it with the ledger.

A file is per request (it has the request-id column) or per day and model. Reconciling pairs
each line with the ledger's net counts (an entry plus the corrections of it) and says, line by
line and in total: matched, differs (beyond the vendor's tolerance), missing in the ledger, or
missing in the invoice (a ledger entry of the vendor's models, in the invoice's days, that the
vendor did not report).
"""

import csv
import hashlib
import io
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal, InvalidOperation

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Case, F, Q, Sum, When

from billing import ledger
from billing.models import Invoice, InvoiceLine, UsageEntry
from billing.spreadsheet import safe_cell

COUNTS = ("input_tokens", "cached_input_tokens", "output_tokens")
OURS = {"input_tokens": "prompt_tokens", "cached_input_tokens": "cached_prompt_tokens", "output_tokens": "completion_tokens"}


class InvoiceError(ValueError):
    """A file refused whole; `line` is the first bad line (the header is line 1)."""

    def __init__(self, message, line=None):
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


def vendor_settings(vendor):
    try:
        return settings.TOKSTREAM_VENDORS[vendor]
    except KeyError:
        raise InvoiceError(f"unknown vendor {vendor!r}; known: {', '.join(sorted(settings.TOKSTREAM_VENDORS))}") from None


# -- import ------------------------------------------------------------------------------------


def import_invoice(vendor, file_name, data, user=None):
    """(invoice, created): the same file imported again returns the first import, unchanged."""
    columns = vendor_settings(vendor)["columns"]
    digest = hashlib.sha256(data).hexdigest()
    existing = Invoice.objects.filter(vendor=vendor, sha256=digest).first()
    if existing:
        return existing, False
    granularity, lines = parse(data, columns)
    try:
        with transaction.atomic():
            invoice = Invoice.objects.create(vendor=vendor, file_name=file_name, sha256=digest, granularity=granularity, imported_by=user)
            InvoiceLine.objects.bulk_create(InvoiceLine(invoice=invoice, **line) for line in lines)
    except IntegrityError:  # the same file, imported by someone else a moment ago
        return Invoice.objects.get(vendor=vendor, sha256=digest), False
    return invoice, True


def parse(data, columns):
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvoiceError(f"the file is not UTF-8 text ({exc.reason})") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    header = reader.fieldnames or []
    granularity = granularity_of(header, columns)
    lines, seen = [], {}
    for row in reader:
        line = parse_line(row, reader.line_num, granularity, columns)
        key = line["request_id"] if granularity == Invoice.Granularity.REQUEST else (line["day"], line["model"])
        if key in seen:
            bad(line["line_number"], f"the same {'request' if granularity == Invoice.Granularity.REQUEST else 'day and model'} as line {seen[key]}")
        seen[key] = line["line_number"]
        lines.append(line)
    if not lines:
        raise InvoiceError("the file has no lines")
    return granularity, lines


def granularity_of(header, columns):
    missing = [columns[name] for name in ("input_tokens", "output_tokens") if columns[name] not in header]
    if missing:
        raise InvoiceError(f"the header lacks the column(s) {', '.join(missing)}", line=1)
    if columns["request_id"] in header:
        return Invoice.Granularity.REQUEST
    if columns["day"] in header and columns["model"] in header:
        return Invoice.Granularity.DAY
    raise InvoiceError(f"the header needs {columns['request_id']!r}, or {columns['day']!r} and {columns['model']!r}", line=1)


def parse_line(row, number, granularity, columns):
    def value(name):
        return (row.get(columns[name]) or "").strip()

    if None in row:
        raise InvoiceError("more fields than the header has", line=number)
    line = {"line_number": number, "model": value("model"), "cost": cost_of(value("cost"), number)}
    line.update({name: count_of(value(name), name, number) for name in COUNTS})
    if granularity == Invoice.Granularity.REQUEST:
        line["request_id"] = value("request_id") or bad(number, f"no {columns['request_id']}")
        line["day"] = day_of(value("day"), number) if value("day") else None
    else:
        line["day"] = day_of(value("day"), number)
        line["model"] = line["model"] or bad(number, f"no {columns['model']}")
    return line


def bad(number, message):
    raise InvoiceError(message, line=number)


def count_of(text, name, number):
    if name == "cached_input_tokens" and not text:
        return 0
    if not text.isdigit():
        bad(number, f"{name} must be a whole number of tokens, not {text!r}")
    return int(text)


def cost_of(text, number):
    if not text:
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        bad(number, f"cost must be a number, not {text!r}")


def day_of(text, number):
    try:
        return date.fromisoformat(text[:10])
    except ValueError:
        bad(number, f"the date must be YYYY-MM-DD, not {text!r}")


# -- reconciliation ----------------------------------------------------------------------------


@dataclass
class Counts:
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal | None = None

    @classmethod
    def of_line(cls, line):
        return cls(line.input_tokens, line.cached_input_tokens, line.output_tokens, line.cost)


@dataclass
class Outcome:
    status: str  # matched, differs, missing_in_ledger, missing_in_invoice
    key: str  # the request id, or "day model"
    line: InvoiceLine | None = None
    entry: UsageEntry | None = None  # per request: the usage entry a difference would correct
    ours: Counts | None = None
    theirs: Counts | None = None
    differences: dict = field(default_factory=dict)  # vendor minus ledger, by count (and cost)


def reconcile(invoice):
    """Every outcome, lines first in file order, then what only the ledger has."""
    rules = vendor_settings(invoice.vendor)
    lines = list(invoice.lines.all())
    if invoice.granularity == Invoice.Granularity.REQUEST:
        ours, entries = net_by_request(lines, rules, invoice)
        keyed = {line.request_id: line for line in lines}
    else:
        ours, entries = net_by_day(lines, rules), {}
        keyed = {day_key(line.day, line.model): line for line in lines}
    outcomes = [compare(key, line, ours.get(key), entries.get(key), rules) for key, line in keyed.items()]
    outcomes += [Outcome("missing_in_invoice", key, entry=entries.get(key), ours=counts) for key, counts in ours.items() if key not in keyed]
    return outcomes


def compare(key, line, ours, entry, rules):
    theirs = Counts.of_line(line)
    if ours is None:
        return Outcome("missing_in_ledger", key, line=line, theirs=theirs)
    differences = {name: getattr(theirs, name) - getattr(ours, name) for name in COUNTS}
    if theirs.cost is not None and ours.cost is not None:
        differences["cost"] = theirs.cost - ours.cost
    within = all(abs(v) <= rules.get("tolerance_tokens", 0) for k, v in differences.items() if k != "cost")
    within = within and abs(differences.get("cost", Decimal(0))) <= Decimal(str(rules.get("tolerance_cost", "0")))
    return Outcome("matched" if within else "differs", key, line, entry, ours, theirs, differences)


def vendor_models(rules, lines):
    return set(rules.get("models") or []) or {line.model for line in lines if line.model}


def of_models(models):
    """Entries of these models, by our name or by the name the vendor served them under."""
    return Q(model__in=models) | Q(model_served__in=models)


def period(lines, entries):
    """The invoice's days, or the days of the entries it names when it gives none."""
    days = [line.day for line in lines if line.day] or [e.received_at.date() for e in entries]
    if not days:
        return None
    start = datetime.combine(min(days), time.min, tzinfo=UTC)
    return start, datetime.combine(max(days) + timedelta(days=1), time.min, tzinfo=UTC)


def request_key(entry, named):
    """A line names a request by our id, or by the vendor's (a relayed request)."""
    return entry.vendor_request_id if entry.vendor_request_id in named else entry.request_id


def net_by_request(lines, rules, invoice):
    """line key -> net Counts, and line key -> usage entry, for the invoice's requests and
    every other entry of the vendor's models in its period."""
    named = {line.request_id for line in lines}
    usage = UsageEntry.objects.filter(kind=UsageEntry.Kind.USAGE)
    entries = {request_key(e, named): e for e in usage.filter(Q(request_id__in=named) | Q(vendor_request_id__in=named))}
    span = period(lines, entries.values())
    if span:
        others = usage.filter(of_models(vendor_models(rules, lines)), received_at__gte=span[0], received_at__lt=span[1])
        entries.update({request_key(e, named): e for e in others if request_key(e, named) not in entries})
    corrections = defaultdict(list)
    for correction in UsageEntry.objects.filter(corrects__in=entries.values()).exclude(kind=UsageEntry.Kind.USAGE):
        corrections[correction.corrects_id].append(correction)
    return {key: net_counts(e, corrections[e.pk]) for key, e in entries.items()}, entries


def net_counts(entry, corrections):
    rows = [entry, *corrections]
    costs = [r.total_cost for r in rows if r.total_cost is not None]
    return Counts(
        sum(r.prompt_tokens for r in rows),
        sum(r.cached_prompt_tokens for r in rows),
        sum(r.completion_tokens for r in rows),
        sum(costs) if entry.total_cost is not None else None,
    )


def day_key(day, model):
    return f"{day.isoformat()} {model}"


def net_by_day(lines, rules):
    """ "day model" -> the ledger's net Counts (corrections count on their entry's day)."""
    span = period(lines, [])
    rows = (
        UsageEntry.objects.filter(of_models(vendor_models(rules, lines)), received_at__gte=span[0], received_at__lt=span[1])
        .annotate(served=Case(When(model_served="", then=F("model")), default=F("model_served")))
        .values("received_at__date", "served")
        .annotate(i=Sum("prompt_tokens"), c=Sum("cached_prompt_tokens"), o=Sum("completion_tokens"), cost=Sum("total_cost"))
    )
    return {day_key(r["received_at__date"], r["served"]): Counts(r["i"], r["c"], r["o"], r["cost"]) for r in rows}


def totals(outcomes):
    """Per status, how many; and the token and cost differences summed over all lines."""
    summary = defaultdict(int)
    for outcome in outcomes:
        summary[outcome.status] += 1
        for name, value in outcome.differences.items():
            summary[f"{name}_difference"] += value
    return dict(summary)


def adjust_to_invoice(invoice, key):
    """Turn a per-request difference into an adjustment entry: the ledger then says what the
    vendor billed. Staff clicking twice make one: the invoice row is locked, and a line that
    already has its adjustment is matched by then."""
    with transaction.atomic():
        Invoice.objects.select_for_update().get(pk=invoice.pk)
        outcome = next((o for o in reconcile(invoice) if o.key == key), None)
        if outcome is None or outcome.status != "differs" or outcome.entry is None:
            raise InvoiceError(f"{key!r} is not a differing per-request line of this invoice (now)")
        changes = {OURS[name]: outcome.differences[name] for name in COUNTS if outcome.differences[name]}
        if outcome.differences.get("cost"):
            changes["total_cost"] = outcome.differences["cost"]
        reason = f"invoice {invoice.pk} ({invoice.vendor}, {invoice.file_name}) line {outcome.line.line_number}"
        return ledger.adjust(outcome.entry, reason, **changes)


REPORT_COLUMNS = [
    "status",
    "key",
    "line",
    *[f"ours_{n}" for n in COUNTS],
    "ours_cost",
    *[f"theirs_{n}" for n in COUNTS],
    "theirs_cost",
    *[f"difference_{n}" for n in COUNTS],
    "difference_cost",
]


def report_rows(outcomes):
    """The reconciliation as CSV rows (header first)."""
    yield REPORT_COLUMNS
    for o in outcomes:
        ours = [getattr(o.ours, n) if o.ours else "" for n in (*COUNTS, "cost")]
        theirs = [getattr(o.theirs, n) if o.theirs else "" for n in (*COUNTS, "cost")]
        diffs = [o.differences.get(n, "") for n in (*COUNTS, "cost")]
        row = [o.status, o.key, o.line.line_number if o.line else "", *["" if v is None else v for v in ours + theirs], *diffs]
        yield [safe_cell(value) for value in row]  # a vendor's text never runs as a formula
