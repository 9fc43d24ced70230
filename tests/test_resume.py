"""The events URL replays a request's stream after Last-Event-ID, for its owner only."""

import json
import time

import httpx
import pytest

from billing.models import ApiKey, UsageEntry
from inference import lifecycle, streamlog
from inference.gateway.admission import Owner, meta_of
from inference.protocol.entries import Open
from inference.protocol.payloads import Admitted
from tests.sse import auth, chat_body, content_of, events, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)


def replay(service, key, request_id, header=None, **params):
    headers = {**auth(key), **({"Last-Event-ID": header} if header else {})}
    url = f"{service.url}/v1/chat/completions/{request_id}/events"
    with httpx.stream("GET", url, headers=headers, params=params, timeout=60) as response:
        return response.status_code, list(events(response)) if response.status_code == 200 else response.read()


@pytest.fixture
def finished(live_service, api_key):
    return stream_chat(
        live_service, api_key, chat_body("Name five colours.", temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True})
    )


def test_it_replays_exactly_the_events_after_the_last_one_seen(live_service, api_key, finished):
    request_id = finished[0][1]["id"]
    cut = 4
    status, rest = replay(live_service, api_key, request_id, header=finished[cut - 1][0])
    assert status == 200
    assert content_of(d for _, d in finished[:cut]) + content_of(d for _, d in rest[:-1]) == content_of(d for _, d in finished[:-1])
    assert [i for i, _ in rest][0] == finished[cut][0]
    assert rest[-1][1] == "[DONE]"


def test_a_resume_from_inside_the_last_entry_sends_only_what_is_missing(live_service, api_key, finished):
    request_id = finished[0][1]["id"]
    status, rest = replay(live_service, api_key, request_id, header=finished[-3][0])
    assert status == 200
    # After the finish chunk: the usage chunk (the request asked for it), then [DONE].
    [(_, usage), (_, done)] = rest
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    assert done == "[DONE]"


@pytest.mark.parametrize("cut", [1, 5, -3])
def test_resumed_events_equal_the_uncut_streams_after_that_id(live_service, api_key, finished, cut):
    """As the request asked: usage at the end only, not on every chunk."""
    status, rest = replay(live_service, api_key, finished[0][1]["id"], header=finished[cut - 1][0])
    assert status == 200 and rest == finished[cut:]


def test_an_id_past_the_end_of_a_finished_request_is_204(live_service, api_key, finished):
    last, _, _ = finished[-1][0].partition(".")
    ms, _, seq = last.partition("-")
    for past in (f"{ms}-{int(seq) + 1}", f"{int(ms) + 1000}-0", f"{ms}-{seq}"):
        status, _ = replay(live_service, api_key, finished[0][1]["id"], header=past)
        assert status == 204, past


def test_it_answers_204_once_everything_was_seen(live_service, api_key, finished):
    request_id = finished[0][1]["id"]
    status, _ = replay(live_service, api_key, request_id, header=finished[-1][0])
    assert status == 204


def test_the_query_parameter_works_for_clients_without_headers(live_service, api_key, finished):
    request_id = finished[0][1]["id"]
    status, rest = replay(live_service, api_key, request_id, last_event_id=finished[-3][0])
    assert status == 200 and len(rest) == 2 and rest[-1][1] == "[DONE]"


def test_an_unknown_or_expired_id_is_404_or_204_for_eventsource(live_service, api_key):
    assert replay(live_service, api_key, "chatcmpl-expired")[0] == 404
    url = f"{live_service.url}/v1/chat/completions/chatcmpl-expired/events"
    response = httpx.get(url, headers={**auth(api_key), "Accept": "text/event-stream"}, timeout=30)
    assert response.status_code == 204  # EventSource stops reconnecting


def test_only_the_owner_may_read_it(live_service, api_key, finished):
    _, other = ApiKey.issue("someone else")
    request_id = finished[0][1]["id"]
    assert replay(live_service, other, request_id)[0] == 404
    assert replay(live_service, "tsk-wrong", request_id)[0] == 401


@pytest.mark.parametrize("bad", ["yesterday", "0-0.0", "0-0", "99999999999999999999999-0", "1-18446744073709551616", "1-2.3.4", "-1-0"])
def test_a_malformed_last_event_id_is_refused(live_service, api_key, finished, bad):
    status, body = replay(live_service, api_key, finished[0][1]["id"], header=bad)
    assert status == 400
    assert json.loads(body)["error"]["param"] == "last_event_id"


@pytest.mark.parametrize("bad", ["１-０", "١-٠", "1-0\n", "1-０.1"])
def test_a_last_event_id_in_other_digits_is_refused_before_anything_streams(live_service, api_key, finished, bad):
    status, body = replay(live_service, api_key, finished[0][1]["id"], last_event_id=bad)  # as a query parameter: headers are ASCII
    assert status == 400
    assert json.loads(body)["error"]["param"] == "last_event_id"


def test_a_stream_whose_model_no_worker_serves_ends_with_an_error(live_service, api_key, redis_client):
    """A worker that died mid-request must not leave its readers waiting for ever."""
    key = ApiKey.authenticate(api_key)
    orphan = Admitted("chatcmpl-orphan", "a-model-no-worker-has", 0, 3, 1, time.time())
    streamlog.admit(redis_client, orphan.request_id, meta_of(orphan, Owner(api_key_id=key.pk), include_usage=True), Open(1, 0))
    status, events = replay(live_service, api_key, orphan.request_id)
    assert status == 200
    [(_, opened), (_, error), (_, usage), (_, done)] = events
    assert opened["tokstream"]["queue_position"] == 0
    assert error["error"]["code"] == "worker_unavailable" and done == "[DONE]"
    assert usage["usage"]["completion_tokens"] == 0
    # A late worker will not start it: its claim finds it ended.
    assert lifecycle.claim(redis_client, orphan.request_id, orphan.model, "late-worker") == "ended"
    entry = UsageEntry.objects.get(request_id=orphan.request_id)
    assert entry.status == "failed" and entry.api_key == key and entry.prompt_tokens == 0
