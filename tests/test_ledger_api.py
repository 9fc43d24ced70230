"""The ledger over REST: scoped to the key, filtered, paged without skips, exported whole."""

import base64
import csv
import io
import json
import time
from decimal import Decimal

import pytest
from drf_spectacular.validation import validate_schema

from billing import ledger
from billing.api import EntryFilter
from billing.models import ApiKey, PriceSheet, UsageEntry
from billing.spreadsheet import safe_cell

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/api/ledger/entries/"
DAILY = "/api/ledger/daily/"


def key_with(scopes):
    key, raw = ApiKey.issue(scopes, scopes=scopes)
    return key, {"HTTP_AUTHORIZATION": f"Bearer {raw}"}


def entries(count, key, model="m", status="stop"):
    now = time.time()
    for n in range(count):
        ledger.record(
            f"r-{key.pk}-{model}-{now}-{n}", status, api_key_id=key.pk, model=model, tokenizer="t", prompt_tokens=10 + n,
            completion_tokens=n, received_at=ledger.as_datetime(now + n / 1000), finished_at=ledger.as_datetime(now + 1),
        )  # fmt: skip


def streamed(response):
    return b"".join(response.streaming_content).decode()


def test_csv_and_ndjson_of_one_filter_hold_the_same_rows_and_totals(client):
    key, auth = key_with("ledger:read")
    entries(7, key, model="a")
    entries(3, key, model="b")
    csv_rows = list(csv.DictReader(io.StringIO(streamed(client.get(URL, {"model": "a"}, HTTP_ACCEPT="text/csv", **auth)))))
    response = client.get(URL, {"model": "a", "format": "ndjson"}, **auth)
    json_rows = [json.loads(line) for line in streamed(response).splitlines()]
    assert [r["request_id"] for r in csv_rows] == [r["request_id"] for r in json_rows] and len(json_rows) == 7
    assert sum(int(r["prompt_tokens"]) for r in csv_rows) == sum(r["prompt_tokens"] for r in json_rows) == sum(range(10, 17))
    assert response["X-Ledger-Last-Hash"] == UsageEntry.objects.get(request_id=json_rows[-1]["request_id"]).entry_hash


def test_cursor_pages_neither_skip_nor_repeat_while_entries_arrive(client):
    key, auth = key_with("ledger:read")
    entries(25, key)
    first = client.get(URL, {"page_size": 10}, **auth).json()
    entries(5, key, model="late")
    seen, page = [e["id"] for e in first["results"]], first
    while page["next"]:
        page = client.get(page["next"], **auth).json()
        seen += [e["id"] for e in page["results"]]
    assert seen == sorted(set(seen)) and len(seen) == 30


def test_a_key_reads_only_its_own_entries_unless_it_may_read_all(client):
    mine, my_auth = key_with("ledger:read")
    theirs, _ = key_with("chat")
    entries(2, mine)
    entries(3, theirs)
    assert {e["api_key"] for e in client.get(URL, **my_auth).json()["results"]} == {mine.pk}
    _, all_auth = key_with("ledger:read:all")
    assert len(client.get(URL, **all_auth).json()["results"]) == 5
    _, chat_auth = key_with("chat")
    assert client.get(URL, **chat_auth).status_code == 403
    assert client.get(URL).status_code in (401, 403)


def openai_error(response, status):
    """The error of a response that must be `status`, in the OpenAI shape, as JSON."""
    assert (response.status_code, response["Content-Type"]) == (status, "application/json"), response
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error" and error["message"]
    return error


BAD_VALUES = [
    {"received_after": "yesterday"}, {"received_before": "9999-12-31T23:00:00-05:00"}, {"received_after": "0001-01-01T00:00:00+05:00"},
    {"status": "bogus"}, {"colour": "red"}, {"api_key": "x"}, {"api_key": "1.5"}, {"api_key": "9" * 30}, {"user": "-1"},
    {"counts_differ": "maybe"}, {"page_size": "abc"}, {"page_size": "0"}, {"page_size": "-1"}, {"page_size": str(10**9)},
    {"page_size": ""}, {"format": "xml"}, {"model": "a\x00b"},
]  # fmt: skip


@pytest.mark.parametrize("query", BAD_VALUES)
def test_bad_filters_answer_400_naming_the_parameter(client, query):
    _, auth = key_with("ledger:read")
    assert openai_error(client.get(URL, query, **auth), 400)["param"] == next(iter(query))


ASKED = {
    "format=csv": ({"format": "csv"}, {}),
    "format=ndjson": ({"format": "ndjson"}, {}),
    "Accept csv": ({}, {"HTTP_ACCEPT": "text/csv"}),
    "Accept ndjson": ({}, {"HTTP_ACCEPT": "application/x-ndjson"}),
    "json": ({}, {}),
}


@pytest.mark.parametrize("asked", ASKED)
def test_errors_are_openai_json_whatever_format_was_asked(client, asked):
    query, headers = ASKED[asked]
    _, auth = key_with("ledger:read")
    _, chat = key_with("chat")
    assert openai_error(client.get(URL, {**query, "received_after": "yesterday"}, **headers, **auth), 400)["param"] == "received_after"
    assert openai_error(client.get(URL, query, **headers), 401)["code"] == "not_authenticated"
    assert openai_error(client.get(URL, query, **headers, HTTP_AUTHORIZATION="Bearer not-a-key"), 401)["code"] == "invalid_api_key"
    assert openai_error(client.get(URL, query, **headers, **chat), 403)["code"] == "insufficient_scope"


@pytest.mark.parametrize(
    "query, headers, status, param",
    [
        ({"format": "csv"}, {}, 400, "format"),
        ({}, {"HTTP_ACCEPT": "text/csv"}, 406, None),
        ({"received_after": "x"}, {}, 400, "received_after"),
        ({"page_size": "10"}, {}, 400, "page_size"),
    ],
)
def test_daily_errors_are_openai_json_too(client, query, headers, status, param):
    _, auth = key_with("ledger:read")
    assert openai_error(client.get(DAILY, query, **headers, **auth), status)["param"] == param


def test_format_overrides_accept_and_406_is_for_an_accept_we_cannot_meet(client):
    key, auth = key_with("ledger:read")
    entries(2, key)
    response = client.get(URL, {"format": "csv"}, HTTP_ACCEPT="application/json", **auth)
    assert (response.status_code, response["Content-Type"]) == (200, "text/csv")
    assert "text/csv" in openai_error(client.get(URL, HTTP_ACCEPT="application/xml", **auth), 406)["message"]
    assert client.get(URL, HTTP_ACCEPT="", **auth)["Content-Type"] == "application/json"  # blank: as if not sent
    assert client.options(f"{URL}?format=csv", **auth).json()["name"] == "Entries"  # DRF's description, as JSON


def cursor(text):
    return base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("position", ["abc", "1e400", "-5", "1.5", " 7", "\u0663", "9" * 20, "9" * 5000])
def test_a_cursor_whose_position_is_not_an_id_is_a_400(client, position):
    key, auth = key_with("ledger:read")
    entries(3, key)
    error = openai_error(client.get(URL, {"cursor": cursor(f"p={position}")}, **auth), 400)
    assert (error["param"], error["code"]) == ("cursor", "invalid_cursor")


@pytest.mark.parametrize("encoded", ["cD1", cursor("o=-1"), cursor("r=x&p=1"), "\u00e9"])
def test_a_malformed_cursor_is_a_400_not_drfs_404(client, encoded):
    _, auth = key_with("ledger:read")
    assert openai_error(client.get(URL, {"cursor": encoded}, **auth), 400)["param"] == "cursor"


def test_the_export_states_its_range_from_the_parsed_times(client):
    key, auth = key_with("ledger:read")
    entries(1, key)
    # A trailing newline passes the datetime parser; copied into the header, it was a 500.
    query = {"format": "csv", "received_after": "2024-01-01T00:00:00\n", "received_before": "2100-01-01T00:00:00+02:00"}
    response = client.get(URL, query, **auth)
    assert response.status_code == 200 and response["X-Ledger-Range"] == "2024-01-01T00:00:00+00:00/2099-12-31T22:00:00+00:00"


def test_the_csv_export_never_carries_a_formula_and_keeps_negative_numbers(client):
    key, auth = key_with("ledger:read")
    prices = dict(input_per_million=Decimal(1), cached_input_per_million=Decimal(1), output_per_million=Decimal(2))
    PriceSheet.objects.create(model="m", effective_from=ledger.as_datetime(0), **prices)
    now = time.time()
    entry = ledger.record(
        "r-formula", "stop", api_key_id=key.pk, model="m", tokenizer="t", prompt_tokens=10, completion_tokens=5,
        vendor_request_id='=HYPERLINK("http://evil.example","x")', received_at=ledger.as_datetime(now), finished_at=ledger.as_datetime(now),
    )  # fmt: skip
    ledger.reverse(entry, "@SUM(1+1)*cmd|' /C calc'!A0")
    usage, reversal = csv.DictReader(io.StringIO(streamed(client.get(URL, {"format": "csv"}, **auth))))
    assert usage["vendor_request_id"] == "'" + entry.vendor_request_id
    assert reversal["error"] == "'@SUM(1+1)*cmd|' /C calc'!A0"
    assert (reversal["prompt_tokens"], reversal["completion_tokens"], reversal["total_cost"]) == ("-10", "-5", "-0.000020000")
    [first, _] = [json.loads(line) for line in streamed(client.get(URL, {"format": "ndjson"}, **auth)).splitlines()]
    assert first["vendor_request_id"] == entry.vendor_request_id  # JSON is typed: no spreadsheet reads it


@pytest.mark.parametrize(
    "value, cell",
    [
        ("=1+1", "'=1+1"), ("+1+1", "'+1+1"), ("-1+1", "'-1+1"), ("@SUM(A1)", "'@SUM(A1)"), ("\t=1", "'\t=1"), ("\r=1", "'\r=1"),
        ("-", "'-"), ("-12", "-12"), ("-0.000020000", "-0.000020000"), ("+3e5", "+3e5"), (-12, -12), (Decimal("-1.5"), Decimal("-1.5")),
        ("a=b", "a=b"), ("", ""), (None, None),
    ],
)  # fmt: skip
def test_a_spreadsheet_cell_is_text_unless_it_is_a_number(value, cell):
    assert safe_cell(value) == cell


def test_the_schema_has_the_pages_the_filters_and_the_errors(client):
    schema = client.get("/api/schema/", {"format": "json"}).json()
    validate_schema(schema)
    entries_get, daily_get = schema["paths"][URL]["get"], schema["paths"][DAILY]["get"]
    assert {p["name"] for p in entries_get["parameters"]} == {*EntryFilter.base_filters, "cursor", "page_size", "format"}
    assert {p["name"] for p in daily_get["parameters"]} == {*EntryFilter.base_filters, "format"}
    page = entries_get["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert schema["components"]["schemas"][page]["properties"]["results"]["items"] == {"$ref": "#/components/schemas/Entry"}
    assert {"next", "previous"} <= set(schema["components"]["schemas"][page]["properties"])
    assert {"text/csv", "application/x-ndjson"} <= set(entries_get["responses"]["200"]["content"])
    for operation in (entries_get, daily_get):
        for status in ("400", "401", "403", "406"):
            assert operation["responses"][status]["content"] == {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    assert set(schema["components"]["schemas"]["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}


def test_daily_totals_and_the_schema(client):
    key, auth = key_with("ledger:read")
    entries(4, key)
    [day] = client.get("/api/ledger/daily/", **auth).json()
    assert (day["model"], day["requests"], day["prompt_tokens"], day["completion_tokens"]) == ("m", 4, 46, 6)
    assert day["cost"] is None  # unpriced: unknown, not zero
    assert b"/api/ledger/entries/" in client.get("/api/schema/").content


def test_a_key_without_the_chat_scope_cannot_chat(client):
    _, auth = key_with("ledger:read")
    response = client.get("/v1/models", **auth)
    assert response.status_code == 403 and response.json()["error"]["code"] == "insufficient_scope"


def test_entries_carry_their_time_to_first_token_and_tokens_per_second(client):
    key, auth = key_with("ledger:read")
    now = time.time()
    ledger.record(
        "r-timed", "stop", api_key_id=key.pk, model="m", tokenizer="t", prompt_tokens=5, completion_tokens=10,
        received_at=ledger.as_datetime(now), started_at=ledger.as_datetime(now + 0.2), first_token_at=ledger.as_datetime(now + 0.5),
        finished_at=ledger.as_datetime(now + 1.5),
    )  # fmt: skip
    [row] = client.get(URL, **auth).json()["results"]
    assert (row["queued_ms"], row["first_token_after_start_ms"], row["duration_ms"], row["tokens_per_second"]) == (200, 300, 1500, 10.0)
