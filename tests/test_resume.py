"""The events URL replays a request's stream after Last-Event-ID, for its owner only."""

import json

import httpx
import pytest

from billing.models import ApiKey, UsageEntry
from inference import streamlog
from inference.admission import Admitted, Owner
from tests.sse import auth, chat_body, content_of, events, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)


def replay(service, key, request_id, header=None, **params):
    headers = {**auth(key), **({"Last-Event-ID": header} if header else {})}
    url = f"{service.url}/v1/chat/completions/{request_id}/events"
    with httpx.stream("GET", url, headers=headers, params=params, timeout=60) as response:
        return response.status_code, list(events(response)) if response.status_code == 200 else response.read()


@pytest.fixture
def finished(live_service, api_key):
    return stream_chat(live_service, api_key, chat_body("Name five colours.", temperature=0, max_tokens=20, stream=True))


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
    status, rest = replay(live_service, api_key, request_id, header=finished[-2][0])
    assert status == 200
    # After the finish chunk: the usage chunk (the events view always includes it), then [DONE].
    [(_, usage), (_, done)] = rest
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 20
    assert done == "[DONE]"


def test_it_answers_204_once_everything_was_seen(live_service, api_key, finished):
    request_id = finished[0][1]["id"]
    status, _ = replay(live_service, api_key, request_id, header=finished[-1][0])
    assert status == 204


def test_the_query_parameter_works_for_clients_without_headers(live_service, api_key, finished):
    request_id = finished[0][1]["id"]
    status, rest = replay(live_service, api_key, request_id, last_event_id=finished[-2][0])
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


def test_a_malformed_last_event_id_is_refused(live_service, api_key, finished):
    status, body = replay(live_service, api_key, finished[0][1]["id"], header="yesterday")
    assert status == 400
    assert json.loads(body)["error"]["param"] == "last_event_id"


def test_a_stream_whose_model_no_worker_serves_ends_with_an_error(live_service, api_key, redis_client):
    """A worker that died mid-request must not leave its readers waiting for ever."""
    key = ApiKey.authenticate(api_key)
    orphan = Admitted("chatcmpl-orphan", "a-model-no-worker-has", 0, 3)
    streamlog.save_meta(redis_client, orphan.request_id, orphan.meta(Owner(api_key_id=key.pk)))
    status, events = replay(live_service, api_key, orphan.request_id)
    assert status == 200
    [(_, error), (_, usage), (_, done)] = events
    assert error["error"]["code"] == "worker_unavailable" and done == "[DONE]"
    assert usage["usage"]["completion_tokens"] == 0
    assert redis_client.get(streamlog.key(orphan.request_id, "cancel"))  # a late worker will not start it
    entry = UsageEntry.objects.get(request_id=orphan.request_id)
    assert entry.status == "failed" and entry.api_key == key and entry.prompt_tokens == 0
