"""Writing the ledger: once per request id, whatever the outcome, priced and chained."""

from datetime import datetime, timezone

from django.db import IntegrityError, connection, transaction

from .models import PriceSheet, UsageEntry

STATUS_OF_REASON = {
    "stop": UsageEntry.Status.COMPLETED,
    "length": UsageEntry.Status.LENGTH,
    "tool_calls": UsageEntry.Status.TOOL_CALLS,
    "cancelled": UsageEntry.Status.CANCELLED,
    "error": UsageEntry.Status.FAILED,
}
CHAIN_LOCK = 0x70CE5  # the PostgreSQL advisory lock that orders the chain's writers


def as_datetime(timestamp):
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=timezone.utc)


def record(request_id, finish_reason, **fields):
    """Create the entry for this request, or return the one a first delivery (or a racing
    writer) already wrote: the unique request id and the transaction decide."""
    entry = UsageEntry(request_id=request_id, finish_reason=finish_reason, status=STATUS_OF_REASON[finish_reason], **fields)
    price(entry)
    try:
        with transaction.atomic():
            append(entry)
    except IntegrityError:
        return UsageEntry.objects.get(request_id=request_id)
    return entry


def price(entry):
    """Costs from the sheet in force when the request arrived; none known: left empty."""
    sheet = PriceSheet.in_force(entry.model, entry.received_at)
    if sheet is not None:
        for name, value in sheet.costs(entry.prompt_tokens, entry.cached_prompt_tokens, entry.completion_tokens).items():
            setattr(entry, name, value)


def append(entry):
    """Link the entry to the newest one and save it; call inside a transaction. Writers take
    turns (an advisory lock on PostgreSQL; SQLite's transactions are IMMEDIATE, see settings)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CHAIN_LOCK])
    entry.previous_hash = UsageEntry.objects.order_by("-id").values_list("entry_hash", flat=True).first() or ""
    entry.entry_hash = entry.content_hash()
    entry.save()


def verify():
    """Walk the chain in order: (entries checked, the first entry that does not match or None)."""
    previous, count = "", 0
    for entry in UsageEntry.objects.order_by("id").iterator(chunk_size=2000):
        if entry.previous_hash != previous or entry.entry_hash != entry.content_hash():
            return count, entry
        previous, count = entry.entry_hash, count + 1
    return count, None
