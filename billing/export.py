"""The ledger as CSV, one way: the admin's export action and the REST export write the same
columns, in the same order, with the same cells, so an auditor can lay one beside the other."""

import csv
import io

from rest_framework import serializers

from billing.models import UsageEntry
from billing.spreadsheet import safe_cell


class EntrySerializer(serializers.ModelSerializer):
    """An entry as the REST API shows it (JSON, NDJSON) and as every CSV row is made."""

    time_to_first_token = serializers.FloatField(read_only=True, help_text="Seconds from arrival to the first token.")
    tokens_per_second = serializers.FloatField(read_only=True, help_text="Completion tokens over the time after the first.")

    class Meta:
        model = UsageEntry
        fields = [f.name for f in UsageEntry._meta.concrete_fields] + ["time_to_first_token", "tokens_per_second"]


COLUMNS = EntrySerializer.Meta.fields


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
