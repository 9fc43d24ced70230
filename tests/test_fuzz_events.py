"""A fuzz of the events URL: request ids, Last-Event-ID (header and query), methods and Accept
headers. No answer is a 5xx; every error is OpenAI's shape; every stream ends with [DONE]."""

import random

import httpx
import pytest

from tests.sse import auth, chat_body, events, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)
HOSTILE = ["", "0", "-1", "0-0", "0-0.0", "1-0.99999", "a-b", "1-1-1", "1.0", " 1-0", "1-0 ", "١-٠", "1-0\t", "%00", "9" * 30 + "-0",
           "18446744073709551615-18446744073709551615", "18446744073709551616-0", "1-0." + "9" * 30, "$", "*", "+", ">", "1e3-0"]  # fmt: skip


def last_ids(rng, finished):
    real = [event_id for event_id, _ in finished]
    ms, _, seq = real[-1].partition(".")[0].partition("-")
    near = [
        f"{ms}-{int(seq) + rng.randint(-3, 3)}",
        f"{int(ms) + rng.randint(-5, 5)}-{rng.randint(0, 9)}",
        f"{real[rng.randrange(len(real))]}.{rng.randint(0, 5)}",
    ]
    return real + near + HOSTILE + [rng.choice(HOSTILE) + rng.choice(real) for _ in range(5)]


def cases(rng, finished, request_id):
    ids = last_ids(rng, finished)
    urls = [request_id, request_id + "x", "chatcmpl-" + "0" * 32, "..", "%2e%2e", "a" * 300, request_id.upper()]
    for _ in range(220):
        yield {
            "request_id": rng.choice(urls) if rng.random() < 0.2 else request_id,
            "method": rng.choice(["GET"] * 8 + ["POST", "DELETE", "HEAD"]),
            "accept": rng.choice(["text/event-stream", "application/json", "*/*", "", "text/html"]),
            "header": rng.choice(ids) if rng.random() < 0.6 else None,
            "query": rng.choice(ids) if rng.random() < 0.3 else None,
        }


def test_the_events_url_never_answers_a_server_error(live_service, api_key):
    finished = stream_chat(
        live_service, api_key, chat_body("Name three birds.", temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True})
    )
    request_id = finished[0][1]["id"]
    failures = []
    with httpx.Client(timeout=60) as client:
        for case in cases(random.Random(1201), finished, request_id):
            problem = check(client, live_service.url, api_key, case)
            if problem:
                failures.append((case, problem))
    assert failures == []


def check(client, url, key, case):
    headers = {**auth(key), **({"Accept": case["accept"]} if case["accept"] else {})}
    if case["header"] is not None:
        headers["Last-Event-ID"] = case["header"]
    params = {"last_event_id": case["query"]} if case["query"] is not None else {}
    try:
        request = client.build_request(case["method"], f"{url}/v1/chat/completions/{case['request_id']}/events", headers=headers, params=params)
    except (httpx.InvalidURL, UnicodeEncodeError, ValueError):
        return None  # a header or URL the client itself cannot send
    try:
        response = client.send(request, stream=True)
    except httpx.LocalProtocolError:
        return None  # nor this
    try:
        return verdict(response, case)
    finally:
        response.close()


def verdict(response, case):
    if response.status_code >= 500:
        return f"{response.status_code}: {response.read()[:200]!r}"
    if response.status_code == 200 and case["method"] == "GET":
        seen = list(events(response))
        return None if seen and seen[-1][1] == "[DONE]" else f"a stream without [DONE]: {seen[-2:]}"
    if response.status_code >= 400 and case["method"] != "HEAD":
        try:
            error = response.read() and response.json().get("error", {})
        except ValueError:
            return f"{response.status_code}, not JSON: {response.content[:80]!r}"
        return None if set(error) == {"message", "type", "param", "code"} else f"not OpenAI's error shape: {error}"
    return None
