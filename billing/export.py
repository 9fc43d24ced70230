"""The ledger as CSV, one way: the admin's export action and the REST export write the same
columns, in the same order, with the same cells, so an auditor can lay one beside the other."""

import csv
import io

from django.http import StreamingHttpResponse
from rest_framework import serializers

from billing.models import UsageEntry
from billing.spreadsheet import safe_cell


class EntrySerializer(serializers.ModelSerializer):
    """An entry as the REST API shows it (JSON, NDJSON) and as every CSV row is made: times in
    whole milliseconds and the rate to a tenth, as the admin shows them."""

    queued_ms = serializers.IntegerField(read_only=True, help_text="Milliseconds from arrival to the start (a worker took it).")
    first_token_after_start_ms = serializers.IntegerField(read_only=True, help_text="Milliseconds from the start to the first token: the queue apart.")
    duration_ms = serializers.IntegerField(read_only=True, help_text="Milliseconds from arrival to the end.")
    tokens_per_second = serializers.SerializerMethodField(help_text="Completion tokens a second after the first token, to a tenth.")

    class Meta:
        model = UsageEntry
        fields = [f.name for f in UsageEntry._meta.concrete_fields] + ["queued_ms", "first_token_after_start_ms", "duration_ms", "tokens_per_second"]

    def get_tokens_per_second(self, entry) -> float | None:
        return None if entry.tokens_per_second is None else round(entry.tokens_per_second, 1)


COLUMNS = EntrySerializer.Meta.fields
EXPORT_CHUNK = 2000  # rows read from the database at a time by a streamed export


def cells(row):
    """One CSV row of an entry's serialized data: text from outside (upstream ids, staff's
    reasons) never opens as a formula."""
    return [safe_cell(row[name]) for name in COLUMNS]


def csv_lines(rows):
    """The header, then one CSV line a serialized row, made as they are read: an export's
    memory stays flat however many rows."""
    yield csv_line(COLUMNS)
    for row in rows:
        yield csv_line(cells(row))


def csv_line(values):
    buffer = io.StringIO()
    csv.writer(buffer).writerow(values)
    return buffer.getvalue()


def serialized(entries):
    return (EntrySerializer(entry).data for entry in entries)


def csv_response(entries):
    """Every entry of the queryset as a CSV attachment, streamed in id order: an export of the
    whole ledger never sits in memory."""
    response = StreamingHttpResponse(csv_lines(serialized(entries.order_by("id").iterator(chunk_size=EXPORT_CHUNK))), content_type="text/csv")
    response["Content-Disposition"] = 'attachment; filename="ledger.csv"'
    return response
