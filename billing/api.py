"""The ledger over REST: entries (JSON pages, or CSV and NDJSON streamed whole) and daily totals.

A key with `ledger:read` reads its own entries; `ledger:read:all`, or a staff session, reads
all. An export reads a snapshot (the entries up to the newest one when it began) and states its
range and the chain hash of its last entry, so two exports can be checked against each other.
"""

import csv
import io
import json

import django_filters
from django.contrib.auth.models import AnonymousUser
from django.db.models import Count, Sum
from django.db.models.functions import TruncDate
from django.http import StreamingHttpResponse
from rest_framework import authentication, exceptions, pagination, permissions, renderers, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from .models import ApiKey, UsageEntry

EXPORT_CHUNK = 2000


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        header = request.headers.get("Authorization", "")
        if not header.lower().startswith("bearer "):
            return None
        key = ApiKey.from_authorization(header)
        if key is None:
            raise exceptions.AuthenticationFailed("Missing or invalid API key.")
        return key.user or AnonymousUser(), key

    def authenticate_header(self, request):
        return "Bearer"


class ReadsLedger(permissions.BasePermission):
    def has_permission(self, request, view):
        key = request.auth if isinstance(request.auth, ApiKey) else None
        if key is not None:
            return key.has_scope("ledger:read") or key.has_scope("ledger:read:all")
        return bool(request.user and request.user.is_staff)


def visible_entries(request):
    key = request.auth if isinstance(request.auth, ApiKey) else None
    if key is None or key.has_scope("ledger:read:all"):
        return UsageEntry.objects.all()
    return UsageEntry.objects.filter(api_key=key)


class EntryFilter(django_filters.FilterSet):
    received_after = django_filters.IsoDateTimeFilter(field_name="received_at", lookup_expr="gte")
    received_before = django_filters.IsoDateTimeFilter(field_name="received_at", lookup_expr="lt")
    model = django_filters.CharFilter()
    status = django_filters.ChoiceFilter(choices=UsageEntry.Status.choices)
    api_key = django_filters.NumberFilter(field_name="api_key_id")
    user = django_filters.NumberFilter(field_name="user_id")
    counts_differ = django_filters.BooleanFilter()  # a vendor reported other counts than ours

    class Meta:
        model = UsageEntry
        fields = []


PAGING_PARAMS = {"cursor", "page_size", "format"}


def filtered(request):
    """The visible entries the query asks for; 400 for an unknown filter or a bad value."""
    unknown = set(request.query_params) - set(EntryFilter.base_filters) - PAGING_PARAMS
    if unknown:
        raise exceptions.ValidationError({name: "not a filter of the ledger" for name in sorted(unknown)})
    entries = EntryFilter(request.query_params, queryset=visible_entries(request))
    if not entries.is_valid():
        raise exceptions.ValidationError(entries.errors)
    return entries.qs


class EntrySerializer(serializers.ModelSerializer):
    time_to_first_token = serializers.FloatField(read_only=True, help_text="Seconds from arrival to the first token.")
    tokens_per_second = serializers.FloatField(read_only=True, help_text="Completion tokens over the time after the first.")

    class Meta:
        model = UsageEntry
        fields = [f.name for f in UsageEntry._meta.concrete_fields] + ["time_to_first_token", "tokens_per_second"]


class EntryPages(pagination.CursorPagination):
    """Pages by id: entries that arrive while a client pages land after its cursor, so no
    page skips or repeats a row."""

    ordering = "id"
    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000


class CSVRenderer(renderers.BaseRenderer):
    media_type, format = "text/csv", "csv"


class NDJSONRenderer(renderers.BaseRenderer):
    media_type, format = "application/x-ndjson", "ndjson"


class LedgerView(APIView):
    authentication_classes = [ApiKeyAuthentication, authentication.SessionAuthentication]
    permission_classes = [ReadsLedger]


class Entries(LedgerView):
    """GET /api/ledger/entries/: JSON pages, or (Accept or `format=`) CSV or NDJSON streamed whole."""

    renderer_classes = [renderers.JSONRenderer, CSVRenderer, NDJSONRenderer]
    serializer_class = EntrySerializer

    def get(self, request):
        entries = filtered(request)
        if request.accepted_renderer.format in ("csv", "ndjson"):
            return export(request, entries, request.accepted_renderer)
        pages = EntryPages()
        page = pages.paginate_queryset(entries, request, view=self)
        return pages.get_paginated_response(EntrySerializer(page, many=True).data)


def export(request, entries, renderer):
    newest_id, last_hash = entries.order_by("-id").values_list("id", "entry_hash").first() or (0, "")
    snapshot = entries.filter(id__lte=newest_id).order_by("id")
    rows = (EntrySerializer(entry).data for entry in snapshot.iterator(chunk_size=EXPORT_CHUNK))
    lines = csv_lines(rows) if renderer.format == "csv" else (json.dumps(row) + "\n" for row in rows)
    response = StreamingHttpResponse(lines, content_type=renderer.media_type)
    response["X-Ledger-Range"] = f"{request.query_params.get('received_after', '')}/{request.query_params.get('received_before', '')}"
    response["X-Ledger-Last-Hash"] = last_hash
    response["Content-Disposition"] = f'attachment; filename="ledger.{renderer.format}"'
    return response


def csv_lines(rows):
    """One CSV line at a time: the export's memory stays flat however many rows."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=EntrySerializer.Meta.fields)
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
        yield buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
    yield buffer.getvalue()


class Daily(LedgerView):
    """GET /api/ledger/daily/: tokens, cost and requests per day and model."""

    def get(self, request):
        totals = (
            filtered(request)
            .annotate(day=TruncDate("received_at"))
            .values("day", "model")
            .annotate(
                requests=Count("id"),
                prompt_tokens=Sum("prompt_tokens"),
                completion_tokens=Sum("completion_tokens"),
                cost=Sum("total_cost"),
            )
            .order_by("day", "model")
        )
        return Response([daily_row(row) for row in totals])


def daily_row(row):
    cost = None if row["cost"] is None else str(row["cost"])  # unpriced: unknown, not zero
    return {**row, "day": row["day"].isoformat(), "total_tokens": row["prompt_tokens"] + row["completion_tokens"], "cost": cost}
