"""A deterministic fuzz of the ledger's query parameters, in every format (asked by `format=` or
by Accept): no answer is a 5xx, every error is JSON in the OpenAI shape, and every success is
the format that was asked. One seed, so a failure replays; the failing cases are all listed."""

import base64
import csv
import io
import json
import random
import time
from urllib.parse import quote

import pytest

from billing import ledger
from tests.test_ledger_api import DAILY, URL, key_with

pytestmark = pytest.mark.django_db(transaction=True)
SEED, CASES = 12, 240


def b64(text):
    return base64.b64encode(text.encode()).decode()


TIMES = [
    "2024-01-01", "2024-01-01T00:00:00Z", "2024-01-01 00:00:00.123456+02:00", "2024-01-01T00:00:00\n", "2024-02-30T00:00:00",
    "2024-01-01T00:00:00+99:00", "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "+002024-01-01", "yesterday", "",
    "2024-01-01T25:00:00", "1e400", "2024-01-01T00:00:00.1234567890123Z",
]  # fmt: skip
IDS = [
    "1",
    "0",
    "2147483648",
    str(2**63 - 1),
    str(2**63),
    "-1",
    "1.5",
    "1e400",
    "9" * 30,
    "9" * 5000,
    "abc",
    "",
    "\u0663",
    " 1",
    "+1",
    "1_0",
    "NaN",
    "Infinity",
    "0x10",
]
VALUES = {  # each list but the last starts with two good values
    "received_after": TIMES,
    "received_before": TIMES,
    "model": ["m", "", "a\x00b", "=1+1", "\u00e9" * 300, "' OR 1=1 --", "%", "m\n"],
    "status": ["completed", "failed", "COMPLETED", "bogus", "", "\x00"],
    "api_key": IDS,
    "user": IDS,
    "counts_differ": ["true", "false", "1", "0", "TRUE", "yes", "", "null", "\x00"],
    "cursor": [
        b64("p=1"),
        b64("r=1&p=2"),
        b64("p=abc"),
        b64("p=1e400"),
        b64("p=-5"),
        b64("p=" + "9" * 40),
        b64("o=3&p=1"),
        b64("o=-1"),
        b64("r=x"),
        b64("o=99999"),
        "cD1",
        "!!!",
        "",
        "\u00e9",
        b64("p=\x00"),
    ],  # fmt: skip
    "page_size": ["1", "10", "1000", "1001", "0", "-1", "abc", "", str(10**9), "1e3", "9" * 5000, " 5"],
    "colour": ["red"],  # not a parameter at all
}
FORMATS = ["json", "csv", "ndjson", "xml", "", "api", "CSV", "json\x00"]
ACCEPTS = [
    "application/json", "text/csv", "application/x-ndjson", "*/*", "text/*", "application/xml", "text/html",
    "text/csv;q=0.5, application/x-ndjson", "garbage", ";;;", "text/csv;q=abc", "", "*/*;q=0", "application/json; indent=4",
]  # fmt: skip
MEDIA = {"application/json", "text/csv", "application/x-ndjson"}


@pytest.fixture
def auths():
    """Who asks: the key's own reader, a reader of all, a key without the scope, a bad key, nobody."""
    key, own = key_with("ledger:read")
    now = time.time()
    for n in range(5):
        ledger.record(
            f"r-fuzz-{n}", "stop", api_key_id=key.pk, model="m", tokenizer="t", prompt_tokens=n, completion_tokens=n, vendor_request_id=f"=v{n}",
            received_at=ledger.as_datetime(now + n), finished_at=ledger.as_datetime(now + n),
        )  # fmt: skip
    return [own, key_with("ledger:read:all")[1], key_with("chat")[1], {"HTTP_AUTHORIZATION": "Bearer nope"}, {}]


def case(rng, auths):
    """(path with query, headers): a few parameters, good or bad, sometimes one twice or raw
    bytes; the format asked by `format=`, by Accept, or by a fuzzed value of either."""
    pairs = [(name, rng.choice(VALUES[name][:2] if rng.random() < 0.5 else VALUES[name])) for name in rng.sample(sorted(VALUES), rng.randint(0, 3))]
    if pairs and rng.random() < 0.1:
        pairs.append((pairs[0][0], rng.choice(VALUES[pairs[0][0]])))
    headers = dict(rng.choice(auths))
    way, asked = rng.choice(["format", "accept", "fuzz"]), rng.choice(["json", "csv", "ndjson"])
    if way == "format":
        pairs.append(("format", asked))
    elif way == "accept":
        headers["HTTP_ACCEPT"] = {"json": "application/json", "csv": "text/csv", "ndjson": "application/x-ndjson"}[asked]
    else:
        pairs += [("format", rng.choice(FORMATS))] if rng.random() < 0.5 else []
        headers.update({"HTTP_ACCEPT": rng.choice(ACCEPTS)} if rng.random() < 0.8 else {})
    rng.shuffle(pairs)
    query = "&".join(f"{quote(name)}={quote(value)}" for name, value in pairs)
    if rng.random() < 0.05:
        query += rng.choice(["&model=%ff%fe", "&%00=1", "&format=%c3%28", "&received_after=%e2%82"])
    return f"{rng.choice([URL, URL, DAILY])}?{query}", headers


def problem(response):
    """What is wrong with the response, or None."""
    body = b"".join(response.streaming_content) if response.streaming else response.content
    media = response["Content-Type"].split(";")[0]
    if response.status_code >= 500:
        return f"{response.status_code}: {body[:200]!r}"
    if response.status_code >= 400:
        error = json.loads(body).get("error") if media == "application/json" else None
        shaped = isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and error["message"]
        return None if shaped else f"{response.status_code} not in the OpenAI shape: {media} {body[:200]!r}"
    if media == "text/html" and response.wsgi_request.path == DAILY:
        return None  # DRF's browsable page, for staff in a browser
    return parse_problem(media, body.decode()) if media in MEDIA else f"200 as {media}"


def parse_problem(media, text):
    try:
        if media == "text/csv":
            next(csv.DictReader(io.StringIO(text)), None)
        elif media == "application/x-ndjson":
            [json.loads(line) for line in text.splitlines()]
        else:
            json.loads(text)
    except (ValueError, csv.Error) as exc:
        return f"200 {media} does not parse: {exc}"
    return None


REACHED = {(200, media) for media in MEDIA} | {(status, "application/json") for status in (400, 401, 403, 406)}


def test_no_query_is_a_server_error_and_every_error_is_openai_json(client, auths):
    rng = random.Random(SEED)
    client.raise_request_exception = False  # a 500 is a finding to list, not the end of the run
    failures, outcomes = [], set()
    for n in range(CASES):
        path, headers = case(rng, auths)
        response = client.get(path, **headers)
        outcomes.add((response.status_code, response["Content-Type"].split(";")[0]))
        found = problem(response)
        if found:
            failures.append(f"case {n}: GET {path!r} Accept {headers.get('HTTP_ACCEPT')!r}: {found}")
    assert not failures, f"{len(failures)} of {CASES} cases:\n" + "\n".join(failures[:20])
    assert REACHED <= outcomes  # the cases still reach the pages, both exports and each kind of error
