"""The ledger over REST: entries (JSON pages, or CSV and NDJSON streamed whole) and daily totals.

A key with `ledger:read` reads its own entries; `ledger:read:all`, or a staff session, reads
all. An export reads a snapshot (the entries up to the newest one when it began) and states its
range and the chain hash of its last entry, so two exports can be checked against each other.
Every error is JSON in the OpenAI shape, whatever format was asked: the CSV and NDJSON
renderers only ever carry rows.
"""

import datetime as dt
import json

import django_filters
from django import forms
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import PermissionDenied
from django.http import Http404, StreamingHttpResponse
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import (
    authentication,
    exceptions,
    negotiation,
    pagination,
    permissions,
    renderers,
    serializers,
    views,
)
from rest_framework.response import Response

from billing import ledger
from billing.export import EXPORT_CHUNK, EntrySerializer, csv_lines, serialized
from billing.models import ApiKey, UsageEntry
from inference.protocol.errors import ApiError

MAX_ID = 2**63 - 1  # ids are BigAutoField


class ApiKeyAuthentication(authentication.BaseAuthentication):
    def authenticate(self, request):
        header = request.headers.get("Authorization", "")
        if not header.lower().startswith("bearer "):
            return None
        key = ApiKey.from_authorization(header)
        if key is None:
            raise exceptions.AuthenticationFailed("Missing or invalid API key.", code="invalid_api_key")
        return key.user or AnonymousUser(), key

    def authenticate_header(self, request):
        return "Bearer"


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """How the schema tells clients to send a key (drf-spectacular finds it by target_class)."""

    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return build_bearer_security_scheme_object(header_name="Authorization", token_prefix="Bearer")


class ReadsLedger(permissions.BasePermission):
    message = "Reading the ledger needs an API key with the `ledger:read` scope, or a staff session."
    code = "insufficient_scope"

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


# -- filters -----------------------------------------------------------------------------------


def whole_number(text, most):
    """int(text) for plain digits up to `most`, else None: int() alone takes " 1", "+1", "1_0"
    and 4,000-digit numbers, and the database then refuses what does not fit its column."""
    if text.isascii() and text.isdigit() and len(text) <= len(str(most)) and int(text) <= most:
        return int(text)
    return None


class IdField(forms.Field):
    """A row id: Django's DecimalField (django-filter's default) reads 1.5 as 1 and lets 10**30
    through to the database."""

    def to_python(self, value):
        if value in (None, ""):
            return None
        number = whole_number(value, MAX_ID)
        if number is None:
            raise forms.ValidationError("Enter an id: a whole number.", code="invalid")
        return number


class BooleanField(forms.Field):
    """true or false: Django's NullBooleanField reads anything else as "no filter", so
    `counts_differ=yes` would answer every entry."""

    def to_python(self, value):
        if value in (None, ""):
            return None
        try:
            return {"true": True, "1": True, "false": False, "0": False}[value.lower()]
        except KeyError:
            raise forms.ValidationError("Enter true or false.", code="invalid") from None


class UtcDateTimeField(django_filters.fields.IsoDateTimeField):
    """An ISO 8601 time, in UTC: a time whose UTC date is past year 9999 (or before year 1) is
    refused here rather than by the database adapter (an OverflowError on SQLite)."""

    def to_python(self, value):
        value = super().to_python(value)
        try:
            return value and value.astimezone(dt.UTC)
        except OverflowError:
            raise forms.ValidationError("This time is out of range.", code="out_of_range") from None


class IdFilter(django_filters.Filter):
    field_class = IdField


class StrictBooleanFilter(django_filters.BooleanFilter):
    field_class = BooleanField


NOT_COMPARED = "unknown"


class ComparisonField(BooleanField):
    """true, false, or unknown: entries whose counts nobody compared (see UsageEntry.counts_differ)."""

    def to_python(self, value):
        if isinstance(value, str) and value.lower() == NOT_COMPARED:
            return NOT_COMPARED
        try:
            return super().to_python(value)
        except forms.ValidationError:
            raise forms.ValidationError("Enter true, false or unknown.", code="invalid") from None


class ComparisonFilter(StrictBooleanFilter):
    field_class = ComparisonField

    def filter(self, queryset, value):
        if value == NOT_COMPARED:
            return queryset.filter(counts_differ__isnull=True)
        return super().filter(queryset, value)


class TimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcDateTimeField


class EntryFilter(django_filters.FilterSet):
    received_after = TimeFilter(field_name="received_at", lookup_expr="gte")
    received_before = TimeFilter(field_name="received_at", lookup_expr="lt")
    model = django_filters.CharFilter()
    status = django_filters.ChoiceFilter(choices=UsageEntry.Status.choices)
    api_key = IdFilter(field_name="api_key_id")
    user = IdFilter(field_name="user_id")
    counts_differ = ComparisonFilter()  # a vendor reported other counts than ours (unknown: nothing compared)

    class Meta:
        model = UsageEntry
        fields = []


def filtered(request, paging=()):
    """The valid EntryFilter of the query (its .qs: the visible entries it selects); 400 for an
    unknown parameter or a bad value."""
    unknown = set(request.query_params) - set(EntryFilter.base_filters) - {"format", *paging}
    if unknown:
        raise exceptions.ValidationError({name: "not a parameter of this list" for name in sorted(unknown)}, code="unknown_parameter")
    entries = EntryFilter(request.query_params, queryset=visible_entries(request))
    if not entries.is_valid():
        raise exceptions.ValidationError(detail_of(entries.errors))
    return entries


def detail_of(errors):
    """A form's errors as DRF's detail, each with its code (DRF's own conversion drops them)."""
    return {name: [exceptions.ErrorDetail(e["message"], e["code"] or "invalid") for e in found] for name, found in errors.get_json_data().items()}


def bad_parameter(name, message, code="invalid"):
    return exceptions.ValidationError({name: [message]}, code=code)


# -- errors ------------------------------------------------------------------------------------


def openai_error(exc, context):
    """DRF's answer to an API exception (its status and headers, WWW-Authenticate say), with
    the body in the OpenAI shape the rest of the service speaks. None (a server error, which
    Django reports) for anything else."""
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = views.exception_handler(exc, context)
    if response is not None:
        message, param, code = described(exc.detail)
        response.data = ApiError(response.status_code, message, param=param, code=code).body()
    return response


def described(detail):
    """(message, param, code) of DRF's error detail: a string, a list, or a dict by field."""
    if isinstance(detail, dict):
        fields = [(name, first(value)) for name, value in detail.items()]
        return "; ".join(f"{name}: {text}" for name, text in fields), fields[0][0], fields[0][1].code
    text = first(detail)
    return str(text), None, text.code


def first(detail):
    while isinstance(detail, (list, dict)):
        detail = next(iter(detail.values() if isinstance(detail, dict) else detail))
    return detail


class CSVRenderer(renderers.BaseRenderer):
    media_type, format = "text/csv", "csv"


class NDJSONRenderer(renderers.BaseRenderer):
    media_type, format = "application/x-ndjson", "ndjson"


ROWS_ONLY = (CSVRenderer, NDJSONRenderer)  # no render(): export() streams the rows


class LedgerNegotiation(negotiation.DefaultContentNegotiation):
    """`format=` overrides the Accept header (DRF would still match it against Accept, a 406
    for `format=csv` from a client that sends `Accept: application/json`), and an unknown one
    is a bad parameter (400), not DRF's 404. Without `format=`, an Accept header that names
    nothing we make is a 406."""

    def get_accept_list(self, request):
        # A blank Accept is a client that chose nothing, as if it sent none: not one that
        # accepts nothing (DRF's 406).
        return super().get_accept_list(request) or ["*/*"]

    def select_renderer(self, request, renderers, format_suffix=None):
        format = format_suffix or request.query_params.get(self.settings.URL_FORMAT_OVERRIDE)
        if not format:
            try:
                return super().select_renderer(request, renderers, format_suffix)
            except exceptions.NotAcceptable:
                raise exceptions.NotAcceptable(f"Accept one of: {', '.join(r.media_type for r in renderers)}.") from None
        chosen = next((renderer for renderer in renderers if renderer.format == format), None)
        if chosen is None:
            raise bad_parameter("format", f"must be one of: {', '.join(r.format for r in renderers)}")
        return chosen, chosen.media_type


class LedgerView(views.APIView):
    authentication_classes = [ApiKeyAuthentication, authentication.SessionAuthentication]
    permission_classes = [ReadsLedger]
    content_negotiation_class = LedgerNegotiation

    def get_exception_handler(self):
        return openai_error

    def finalize_response(self, request, response, *args, **kwargs):
        # Only the export writes CSV or NDJSON, streaming its rows itself: what DRF renders here
        # (an error, OPTIONS' description) is JSON. An error from content negotiation has left
        # no renderer chosen at all.
        renderer = getattr(request, "accepted_renderer", None)
        if isinstance(response, Response) and (response.exception or renderer is None or isinstance(renderer, ROWS_ONLY)):
            request.accepted_renderer, request.accepted_media_type = renderers.JSONRenderer(), "application/json"
        return super().finalize_response(request, response, *args, **kwargs)


# -- entries -----------------------------------------------------------------------------------


class EntryPages(pagination.CursorPagination):
    """Pages by id: entries that arrive while a client pages land after its cursor, so no
    page skips or repeats a row. A cursor or page size it did not issue is a 400: DRF reads a
    bad page size as the default, a malformed cursor as a 404, and passes a cursor's position
    to the database unchecked (a 500 for p=abc)."""

    ordering = "id"
    page_size = 100
    page_size_query_param = "page_size"
    max_page_size = 1000

    def get_page_size(self, request):
        text = request.query_params.get(self.page_size_query_param)
        if text is None:
            return self.page_size
        size = whole_number(text, self.max_page_size)
        if not size:
            raise bad_parameter("page_size", f"must be a whole number from 1 to {self.max_page_size}")
        return size

    def decode_cursor(self, request):
        try:
            cursor = super().decode_cursor(request)
        except exceptions.NotFound:
            raise invalid_cursor() from None
        if cursor and cursor.position is not None and whole_number(cursor.position, MAX_ID) is None:
            raise invalid_cursor()  # our positions are ids
        return cursor


def invalid_cursor():
    return bad_parameter("cursor", "not a cursor of this list: follow a page's next or previous link", code="invalid_cursor")


# -- schema ------------------------------------------------------------------------------------


class ErrorBodySerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField(help_text="invalid_request_error for every error here.")
    param = serializers.CharField(allow_null=True, help_text="The query parameter at fault, if one is.")
    code = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    error = ErrorBodySerializer()


FILTER_PARAMETERS = [
    OpenApiParameter("received_after", OpenApiTypes.DATETIME, description="Entries received at or after this ISO 8601 time."),
    OpenApiParameter("received_before", OpenApiTypes.DATETIME, description="Entries received before this ISO 8601 time."),
    OpenApiParameter("model", OpenApiTypes.STR, description="The model's public name."),
    OpenApiParameter("status", OpenApiTypes.STR, enum=UsageEntry.Status.values),
    OpenApiParameter("api_key", OpenApiTypes.INT, description="The id of the key that made the requests."),
    OpenApiParameter("user", OpenApiTypes.INT, description="The id of the user the requests were made for."),
    OpenApiParameter(
        "counts_differ",
        OpenApiTypes.STR,
        enum=["true", "false", "unknown"],
        description="Whether a vendor reported other counts than ours; unknown: entries with nothing compared (a local model, or an upstream that reported no usage).",
    ),  # fmt: skip
]


PAGE_PARAMETERS = [
    OpenApiParameter("cursor", OpenApiTypes.STR, description="From a page's `next` or `previous` link; JSON pages only."),
    OpenApiParameter(
        "page_size", {"type": "integer", "minimum": 1, "maximum": EntryPages.max_page_size}, description="Entries a page (100 if not given); JSON pages only."
    ),
]


def format_parameter(formats):
    return OpenApiParameter("format", OpenApiTypes.STR, enum=formats, description="Overrides the Accept header.")


def error_responses(*statuses):
    reasons = {
        400: "An unknown parameter, or a bad value of one (`param` names it).",
        401: "No credentials, or an invalid API key.",
        403: "The key lacks the `ledger:read` scope, or the session is not staff.",
        406: "The Accept header names no format of this endpoint.",
    }
    return {(status, "application/json"): OpenApiResponse(ErrorSerializer, description=reasons[status]) for status in statuses}


class Entries(LedgerView):
    """GET /api/ledger/entries/: JSON pages, or (Accept or `format=`) CSV or NDJSON streamed whole."""

    renderer_classes = [renderers.JSONRenderer, CSVRenderer, NDJSONRenderer]
    pagination_class = EntryPages
    serializer_class = EntrySerializer

    @extend_schema(
        parameters=[*FILTER_PARAMETERS, *PAGE_PARAMETERS, format_parameter(["json", "csv", "ndjson"])],
        responses={
            (200, "application/json"): OpenApiResponse(EntrySerializer(many=True), description="A page of entries, oldest first."),
            (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR, description="Every entry the filters select, a header line first."),
            (200, "application/x-ndjson"): OpenApiResponse(OpenApiTypes.STR, description="Every entry the filters select, one JSON object a line."),
            **error_responses(400, 401, 403, 406),
        },
    )
    def get(self, request):
        filters = filtered(request, paging=("cursor", "page_size"))
        if request.accepted_renderer.format in ("csv", "ndjson"):
            return export(filters, request.accepted_renderer)
        pages = self.pagination_class()
        page = pages.paginate_queryset(filters.qs, request, view=self)
        return pages.get_paginated_response(EntrySerializer(page, many=True).data)


def export(filters, renderer):
    entries = filters.qs
    newest_id, last_hash = entries.order_by("-id").values_list("id", "entry_hash").first() or (0, "")
    snapshot = entries.filter(id__lte=newest_id).order_by("id")
    rows = serialized(snapshot.iterator(chunk_size=EXPORT_CHUNK))
    lines = csv_lines(rows) if renderer.format == "csv" else (json.dumps(row) + "\n" for row in rows)
    response = StreamingHttpResponse(lines, content_type=renderer.media_type)
    response["X-Ledger-Range"] = ledger_range(filters.form.cleaned_data)
    response["X-Ledger-Last-Hash"] = last_hash
    response["Content-Disposition"] = f'attachment; filename="ledger.{renderer.format}"'
    return response


def ledger_range(cleaned):
    """ "after/before" from the parsed times: the query's own text may end in a newline, which
    the datetime parser allows and a header refuses."""
    after, before = cleaned.get("received_after"), cleaned.get("received_before")
    return f"{after.isoformat() if after else ''}/{before.isoformat() if before else ''}"


# -- daily -------------------------------------------------------------------------------------


class DailySerializer(serializers.Serializer):
    day = serializers.DateField()
    model = serializers.CharField()
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=30, decimal_places=9, allow_null=True, help_text="Empty when a model has no price sheet: unknown, not zero.")
    currency = serializers.CharField(help_text="The cost's currency (a model's days in two currencies are two rows); empty when unpriced.")


class Daily(LedgerView):
    """GET /api/ledger/daily/: tokens, cost and requests per day, model and currency."""

    @extend_schema(
        parameters=[*FILTER_PARAMETERS, format_parameter(["json"])],
        responses={(200, "application/json"): DailySerializer(many=True), **error_responses(400, 401, 403, 406)},
    )
    def get(self, request):
        return Response([daily_row(row) for row in ledger.daily_totals(filtered(request).qs)])


def daily_row(row):
    cost = None if row["cost"] is None else str(row["cost"])  # unpriced: unknown, not zero
    return {**row, "day": row["day"].isoformat(), "cost": cost}
