"""Cancel and steer a request by id, and detach it from its POST. A worker dying: tests/faults/."""

import httpx
import pytest

from billing.models import ApiKey
from tests.service import wait_for_entry
from tests.sse import auth, chat_body, content_of, events

pytestmark = pytest.mark.django_db(transaction=True)
ESSAY = "Write a long essay about the history of tea."


def control(service, key, request_id, action, body=None):
    url = f"{service.url}/v1/chat/completions/{request_id}/{action}"
    return httpx.post(url, json=body if body is not None else {}, headers=auth(key), timeout=30)


def stream_with(service, key, body, act_after, act):
    """Stream `body`; after `act_after` events call act(request_id); return all events."""
    seen = []
    with httpx.stream("POST", f"{service.url}/v1/chat/completions", json=body, headers=auth(key), timeout=120) as response:
        for event in events(response):
            seen.append(event)
            if len(seen) == act_after:
                act(event[1]["id"])
    return seen


def test_cancel_by_id_ends_the_stream_and_is_idempotent(live_service, api_key):
    body = chat_body(ESSAY, max_tokens=400, temperature=0, stream=True, stream_options={"include_usage": True})
    answers = []
    streamed = stream_with(live_service, api_key, body, 3, lambda rid: answers.append(control(live_service, api_key, rid, "cancel")))
    assert answers[0].status_code == 200 and answers[0].json()["status"] == "cancelling"
    assert streamed[-3][1]["choices"][0]["finish_reason"] == "cancelled"
    assert streamed[-2][1]["usage"]["completion_tokens"] < 100 and streamed[-1][1] == "[DONE]"
    request_id = streamed[0][1]["id"]
    entry = wait_for_entry(seconds=10, request_id=request_id)
    assert entry.status == "cancelled" and entry.completion_tokens == streamed[-2][1]["usage"]["completion_tokens"]
    again = control(live_service, api_key, request_id, "cancel")
    assert again.status_code == 200 and again.json()["status"] == "finished"


def test_steering_by_id_takes_effect_and_is_billed_as_prompt(live_service, api_key, tokenizer):
    text = " Now write only about pirates."
    body = chat_body(ESSAY, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
    plain = stream_with(live_service, api_key, body, 0, None)
    answers = []
    steered = stream_with(live_service, api_key, body, 4, lambda rid: answers.append(control(live_service, api_key, rid, "steer", {"content": text})))
    assert answers[0].status_code == 202
    [mark] = [c for _, c in steered[:-1] if "steered" in c.get("tokstream", {})]
    assert mark["tokstream"] == {"steered": text} and mark["choices"][0]["delta"] == {"content": ""}
    after = steered.index(next(e for e in steered if e[1] is mark))
    # Text, not chunks: a step may carry several tokens (kept drafts), so two greedy runs of the
    # same reply need not chunk it alike.
    before, plain_text = content_of(c for _, c in steered[:after]), content_of(c for _, c in plain[:-1])
    assert before and plain_text.startswith(before)
    assert content_of(c for _, c in steered[:-1]) != plain_text
    steer_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert steered[-2][1]["usage"]["prompt_tokens"] == plain[-2][1]["usage"]["prompt_tokens"] + steer_tokens
    entry = wait_for_entry(seconds=10, request_id=mark["id"])
    assert entry.prompt_tokens == steered[-2][1]["usage"]["prompt_tokens"]


def test_cancel_and_steer_refuse_what_they_cannot_do(live_service, api_key):
    finished = stream_with(live_service, api_key, chat_body("Hi", max_tokens=2, stream=True), 0, None)
    request_id = finished[0][1]["id"]
    _, other = ApiKey.issue("someone else")
    cases = [
        (control(live_service, api_key, "chatcmpl-unknown", "cancel"), 404),
        (control(live_service, other, request_id, "cancel"), 404),
        (control(live_service, "tsk-wrong", request_id, "steer", {"content": "x"}), 401),
        (control(live_service, api_key, request_id, "steer", {"content": ""}), 400),
        (control(live_service, api_key, request_id, "steer", {"content": "too late"}), 409),
        (httpx.get(f"{live_service.url}/v1/chat/completions/{request_id}/cancel", headers=auth(api_key)), 405),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_detached_request_runs_on_after_its_client_leaves_and_can_be_resumed(live_service, api_key):
    body = chat_body(ESSAY, max_tokens=30, temperature=0, stream=True, stream_options={"include_usage": True}, tokstream={"detach_on_disconnect": True})
    with httpx.stream("POST", f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=60) as response:
        first = []
        for event in events(response):
            first.append(event)
            if len(first) == 3:
                break
    request_id = first[0][1]["id"]
    entry = wait_for_entry(seconds=60, request_id=request_id)
    assert entry.status == "length" and entry.completion_tokens == 30
    url = f"{live_service.url}/v1/chat/completions/{request_id}/events"
    with httpx.stream("GET", url, headers={**auth(api_key), "Last-Event-ID": first[-1][0]}, timeout=60) as response:
        rest = list(events(response))
    whole = httpx.post(
        f"{live_service.url}/v1/chat/completions", json={**body, "stream": False, "stream_options": None}, headers=auth(api_key), timeout=120
    ).json()
    assert content_of(c for _, c in first + rest[:-1]) == whole["choices"][0]["message"]["content"]  # no gap, no repeat
    assert [c for _, c in rest].count("[DONE]") == 1 and rest[-1][1] == "[DONE]"
    assert len([c for _, c in rest[:-1] if c["choices"] == []]) == 1  # the usage chunk, once
