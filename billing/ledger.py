"""Writing the ledger: once per request id, whatever the outcome."""

from datetime import datetime, timezone

from django.db import IntegrityError, transaction

from .models import UsageEntry

STATUS_OF_REASON = {
    "stop": UsageEntry.Status.COMPLETED,
    "tool_calls": UsageEntry.Status.COMPLETED,
    "length": UsageEntry.Status.LENGTH,
    "cancelled": UsageEntry.Status.CANCELLED,
    "error": UsageEntry.Status.FAILED,
}


def as_datetime(timestamp):
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=timezone.utc)


def record(request_id, finish_reason, **fields):
    """Create the entry for this request, or return the one a first delivery already wrote."""
    status = STATUS_OF_REASON[finish_reason]
    try:
        with transaction.atomic():
            return UsageEntry.objects.create(request_id=request_id, finish_reason=finish_reason, status=status, **fields)
    except IntegrityError:
        return UsageEntry.objects.get(request_id=request_id)
