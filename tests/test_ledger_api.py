"""The ledger over REST: scoped to the key, filtered, paged without skips, exported whole."""

import csv
import io
import json
import time

import pytest

from billing import ledger
from billing.models import ApiKey, UsageEntry

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/api/ledger/entries/"


def key_with(scopes):
    key, raw = ApiKey.issue(scopes, scopes=scopes)
    return key, {"HTTP_AUTHORIZATION": f"Bearer {raw}"}


def entries(count, key, model="m", status="stop"):
    now = time.time()
    for n in range(count):
        ledger.record(
            f"r-{key.pk}-{model}-{now}-{n}", status, api_key=key, model=model, tokenizer="t", prompt_tokens=10 + n,
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


@pytest.mark.parametrize("query", [{"received_after": "yesterday"}, {"status": "bogus"}, {"colour": "red"}, {"api_key": "x"}])
def test_bad_filters_answer_400(client, query):
    _, auth = key_with("ledger:read")
    assert client.get(URL, query, **auth).status_code == 400


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
        "r-timed", "stop", api_key=key, model="m", tokenizer="t", prompt_tokens=5, completion_tokens=10,
        received_at=ledger.as_datetime(now), first_token_at=ledger.as_datetime(now + 0.5), finished_at=ledger.as_datetime(now + 1.5),
    )  # fmt: skip
    [row] = client.get(URL, **auth).json()["results"]
    assert row["time_to_first_token"] == pytest.approx(0.5, abs=1e-5) and row["tokens_per_second"] == pytest.approx(10.0, rel=1e-4)
