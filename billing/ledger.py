"""Writing the ledger: once per request id, whatever the outcome, priced and chained."""

import dataclasses
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from django.db import IntegrityError, connection, transaction
from django.db.models import Count, F, Sum
from django.db.models.functions import TruncDate

from billing.models import PriceSheet, UsageEntry
from inference.protocol.entries import FinishReason

STATUS_OF_REASON = {
    FinishReason.STOP: UsageEntry.Status.COMPLETED,
    FinishReason.LENGTH: UsageEntry.Status.LENGTH,
    FinishReason.TOOL_CALLS: UsageEntry.Status.TOOL_CALLS,
    "function_call": UsageEntry.Status.TOOL_CALLS,  # an upstream's older name for it
    "content_filter": UsageEntry.Status.COMPLETED,  # an upstream ended it; what it wrote is billed
    FinishReason.CANCELLED: UsageEntry.Status.CANCELLED,
    FinishReason.ERROR: UsageEntry.Status.FAILED,
}
CHAIN_LOCK = 0x70CE5  # the PostgreSQL advisory lock that orders the chain's writers


@dataclass(frozen=True)
class Provenance:
    """Where an entry's counts came from, and what the ender knows beside them: the model and
    tokenizer that served it, the parts of the prompt, and for a relayed request the vendor's
    report next to our own count."""

    usage_source: str = UsageEntry._meta.get_field("usage_source").default
    model_served: str = ""
    tokenizer: str = ""
    cached_prompt_tokens: int = 0
    steering_tokens: int = 0
    vendor_request_id: str = ""
    counted_prompt_tokens: int | None = None
    counted_completion_tokens: int | None = None
    vendor_prompt_tokens: int | None = None
    vendor_cached_prompt_tokens: int | None = None
    vendor_completion_tokens: int | None = None


def as_datetime(timestamp):
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=UTC)


@dataclass(frozen=True)
class Charge:
    """What one request's entry records, as its ender gives it: whose request, on which model,
    the token counts, the times and where the counts came from."""

    request_id: str
    finish_reason: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    received_at: datetime
    finished_at: datetime
    api_key_id: int | None = None
    user_id: int | None = None
    error: str = ""
    started_at: datetime | None = None
    first_token_at: datetime | None = None
    provenance: Provenance = Provenance()

    def entry(self):
        """The unpriced, unchained row."""
        source = self.provenance
        return UsageEntry(
            request_id=self.request_id,
            finish_reason=self.finish_reason,
            status=STATUS_OF_REASON[self.finish_reason],
            model=self.model,
            api_key_id=self.api_key_id,
            user_id=self.user_id,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            error=self.error,
            received_at=self.received_at,
            started_at=self.started_at,
            first_token_at=self.first_token_at,
            finished_at=self.finished_at,
            usage_source=source.usage_source,
            model_served=source.model_served,
            tokenizer=source.tokenizer,
            cached_prompt_tokens=source.cached_prompt_tokens,
            steering_tokens=source.steering_tokens,
            vendor_request_id=source.vendor_request_id,
            counted_prompt_tokens=source.counted_prompt_tokens,
            counted_completion_tokens=source.counted_completion_tokens,
            vendor_prompt_tokens=source.vendor_prompt_tokens,
            vendor_cached_prompt_tokens=source.vendor_cached_prompt_tokens,
            vendor_completion_tokens=source.vendor_completion_tokens,
        )


PROVENANCE_FIELDS = frozenset(field.name for field in dataclasses.fields(Provenance))


def record(request_id, finish_reason, **fields):
    """For scripts and tests, an entry from keyword fields (a Charge's and its Provenance's):
    created, or the one a first delivery (or a racing writer) already wrote."""
    provenance = Provenance(**{name: value for name, value in fields.items() if name in PROVENANCE_FIELDS})
    others = {name: value for name, value in fields.items() if name not in PROVENANCE_FIELDS}
    return record_once(Charge(request_id, finish_reason, provenance=provenance, **others))[0]


def record_once(charge):
    """(the request's entry, whether this call wrote it): the unique request id and the
    transaction decide which writer's entry stands."""
    entry = charge.entry()
    entry.counts_differ = counts_differ(entry)
    price(entry)
    try:
        with transaction.atomic():
            append(entry)
    except IntegrityError:
        existing = UsageEntry.objects.filter(request_id=charge.request_id).first()
        if existing is None:  # not a second writer: the row itself was refused
            raise
        return existing, False
    return entry, True


def counts_differ(entry):
    """Whether the vendor's counts are not ours; None when there is nothing to compare (a local
    model, or an upstream that reported no usage): unknown, never "they agree"."""
    compared = [
        (entry.vendor_prompt_tokens, entry.counted_prompt_tokens),
        (entry.vendor_completion_tokens, entry.counted_completion_tokens),
    ]
    compared = [(theirs, ours) for theirs, ours in compared if theirs is not None and ours is not None]
    return any(theirs != ours for theirs, ours in compared) if compared else None


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


CORRECTED_FIELDS = (
    "prompt_tokens",
    "cached_prompt_tokens",
    "steering_tokens",
    "completion_tokens",
    "input_cost",
    "cached_input_cost",
    "output_cost",
    "total_cost",
)


class CorrectionError(Exception):
    pass


def reverse(entry, reason):
    """A reversal entry: the entry's counts and costs negated, so every total nets it out."""
    if UsageEntry.objects.filter(corrects=entry, kind=UsageEntry.Kind.REVERSAL).exists():
        raise CorrectionError(f"entry {entry.request_id} is already reversed")
    changes = {name: -getattr(entry, name) for name in CORRECTED_FIELDS if getattr(entry, name) is not None}
    return correct(entry, UsageEntry.Kind.REVERSAL, reason, changes)


def adjust(entry, reason, **changes):
    """An adjustment entry: signed changes to the entry's counts or costs."""
    unknown = set(changes) - set(CORRECTED_FIELDS)
    if unknown:
        raise CorrectionError(f"not a count or cost of an entry: {', '.join(sorted(unknown))}")
    return correct(entry, UsageEntry.Kind.ADJUSTMENT, reason, changes)


def correct(entry, kind, reason, changes):
    if entry.kind != UsageEntry.Kind.USAGE:
        raise CorrectionError("only usage entries are corrected; correct the usage entry itself")
    now = datetime.now(tz=UTC)
    counts = {name: 0 for name in ("prompt_tokens", "completion_tokens")}
    correction = UsageEntry(
        request_id=f"{kind}-{uuid.uuid4().hex[:8]}-{entry.request_id}"[:64], kind=kind, corrects=entry,
        api_key_id=entry.api_key_id, user_id=entry.user_id, model=entry.model, model_served=entry.model_served,
        tokenizer=entry.tokenizer, usage_source="correction", finish_reason=entry.finish_reason, status=entry.status,
        error=reason, received_at=entry.received_at, finished_at=now, price_sheet_id=entry.price_sheet_id,
        currency=entry.currency, **{**counts, **changes},
    )  # fmt: skip
    with transaction.atomic():
        append(correction)
    return correction


def verify():
    """Walk the chain in order: (entries checked, the first entry that does not match or None)."""
    previous, count = "", 0
    for entry in UsageEntry.objects.order_by("id").iterator(chunk_size=2000):
        if entry.previous_hash != previous or entry.entry_hash != entry.content_hash():
            return count, entry
        previous, count = entry.entry_hash, count + 1
    return count, None


def daily_totals(entries):
    """Requests, tokens and cost per day (in the current time zone), model and currency of
    `entries`, oldest day first: the admin's usage chart and the REST daily totals read the same
    sums. A model without a price sheet sums to an empty cost (and currency), unknown, not zero."""
    return (
        entries.annotate(day=TruncDate("received_at"))
        .values("day", "model", "currency")
        .annotate(
            requests=Count("id"),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            cost=Sum("total_cost"),
        )
        .annotate(total_tokens=F("prompt_tokens") + F("completion_tokens"))  # of the sums: the names are theirs now
        .order_by("day", "model", "currency")
    )
