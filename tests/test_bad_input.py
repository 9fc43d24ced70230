"""Bad requests get the OpenAI error shape and leave nothing behind: no task, no row, no keys.
They are refused before anything is queued, so the apps answer them here, in this process."""

import json
import os

import pytest

from billing.models import UsageEntry
from inference.backends import CATALOG
from inference.protocol import chat_request
from tests import asgi
from tests.sse import MODEL, auth, chat_body

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def post(api_key, redis_client):
    """POST a raw body to /v1/chat/completions; assert the error shape and that nothing was written."""

    def request_keys():
        prefix = os.environ["TOKSTREAM_REDIS_PREFIX"]
        return set(redis_client.scan_iter(match=f"{prefix}:req:*"))

    def post(body, status, headers=None, **expected):
        keys_before, rows_before = request_keys(), UsageEntry.objects.count()
        headers = {"Content-Type": "application/json", **auth(api_key), **(headers or {})}
        answered, content = asgi.post_chat(body, headers)
        assert answered == status, content
        error = json.loads(content)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        for name, value in expected.items():
            assert error[name] == value
        # Admission writes the request's metadata just before it queues the task, so no new key
        # means no task; and no ledger row was written by anyone.
        assert request_keys() == keys_before
        assert UsageEntry.objects.count() == rows_before
        return error

    return post


def json_body(**fields):
    return json.dumps(fields).encode()


def test_it_refuses_malformed_json(post):
    post(b'{"model": "smollm2-135m-instruct", "messages": [', 400, type="invalid_request_error")


def test_it_refuses_a_wrong_content_type(post):
    post(json_body(**chat_body("hi")), 400, headers={"Content-Type": "text/plain"})


@pytest.mark.parametrize("messages", [None, [], "hello"])
def test_it_refuses_missing_or_empty_messages(post, messages):
    body = {"model": MODEL} if messages is None else {"model": MODEL, "messages": messages}
    post(json_body(**body), 400, param="messages")


def test_it_refuses_a_message_without_a_known_role(post):
    post(json_body(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]), 400, param="messages.[0].role")


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize(
    "message,param",
    [
        ({"role": "user", "content": "hi", "name": 7}, "messages.[0].name"),
        ({"role": "system", "content": "hi", "name": ["a"]}, "messages.[0].name"),
        ({"role": "tool", "content": "Sunny.", "tool_call_id": ["call_1"]}, "messages.[0].tool_call_id"),
        ({"role": "tool", "content": "Sunny."}, "messages.[0].tool_call_id"),
        ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "id": 1}]}, "messages.[0].tool_calls.[0].id"),
        ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "type": "code"}]}, "messages.[0].tool_calls.[0].type"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}]},
            "messages.[0].tool_calls.[0].function.arguments",
        ),
        ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}, "messages.[0].tool_calls.[0].function.name"),
        ({"role": "assistant", "content": None, "tool_calls": CALL}, "messages.[0].tool_calls"),
        ({"role": "assistant", "content": "no", "refusal": 3}, "messages.[0].refusal"),
    ],
)
def test_it_refuses_a_message_field_of_the_wrong_type(post, message, param):
    """As OpenAI's reference schema types them: it answers these with a 400 naming the field."""
    error = post(json_body(model=MODEL, messages=[message]), 400, param=param)
    assert error["message"].startswith(f"`{param}` ")


def test_it_takes_the_message_fields_openai_defines():
    messages = [
        {"role": "system", "content": "Be brief.", "name": "rules"},
        {"role": "user", "content": "Weather in Paris?", "name": "ana"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
        {"role": "tool", "content": "Sunny.", "tool_call_id": "call_1"},
    ]
    parsed = chat_request.parse(json.dumps({"model": MODEL, "messages": messages}).encode(), "application/json", CATALOG)
    assert parsed.messages[2]["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "tool"]


def test_it_answers_404_for_an_unknown_model(post):
    post(json_body(**{**chat_body("hi"), "model": "gpt-17"}), 404, code="model_not_found", param="model")


@pytest.mark.parametrize("max_tokens", [0, -5, "ten", 10**9])
def test_it_refuses_max_tokens_out_of_range(post, max_tokens):
    post(json_body(**chat_body("hi", max_tokens=max_tokens)), 400, param="max_tokens")


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 3),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_k", -5),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logit_bias", {"99999999": 5}),
        ("logit_bias", {"42": 500}),
        ("logit_bias", [1, 2]),
        ("seed", 1.5),
        ("top_logprobs", 21),
        ("top_logprobs", 3),  # without logprobs: true
        ("logprobs", "yes"),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("tools", [{"type": "function"}]),
        ("tools", [{"type": "function", "function": {"name": "no spaces allowed"}}]),
        ("tool_choice", "required"),
        ("n", 0),
        ("n", 17),
        ("n", 1.5),
        ("stream_options", {"include_usage": True}),
    ],
)
def test_it_refuses_sampling_parameters_out_of_range(post, field, value):
    post(json_body(**chat_body("hi", **{field: value})), 400, param=field)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tokstream": {"beam_width": 0}}, "tokstream.beam_width"),
        ({"tokstream": {"beam_width": 9}}, "tokstream.beam_width"),
        ({"tokstream": {"beam_width": "4"}}, "tokstream.beam_width"),
        ({"tokstream": {"speculative": "no"}}, "tokstream.speculative"),
        ({"tokstream": {"beams": 4}}, "tokstream.beams"),
        ({"tokstream": 4}, "tokstream"),
        ({"tokstream": {"beam_width": 4}, "n": 2}, "n"),
        ({"tokstream": {"beam_width": 4}, "stop": "x"}, "stop"),
        ({"tokstream": {"beam_width": 4}, "logprobs": True}, "logprobs"),
        ({"tokstream": {"beam_width": 4}, "presence_penalty": 1}, "presence_penalty"),
    ],
)
def test_it_refuses_beam_search_it_cannot_honour(post, extra, param):
    post(json_body(**chat_body("hi", **extra)), 400, param=param)


def test_it_refuses_a_prompt_longer_than_the_context(post):
    post(json_body(**chat_body("tea " * 9000)), 400, code="context_length_exceeded")


def test_it_refuses_a_body_over_one_mebibyte(post):
    post(json_body(**chat_body("x" * (1024 * 1024 + 10))), 413)


def test_it_refuses_a_missing_key(post):
    post(json_body(**chat_body("hi")), 401, headers={"Authorization": ""}, code="invalid_api_key")


def test_it_refuses_a_wrong_key(post):
    post(json_body(**chat_body("hi")), 401, headers={"Authorization": "Bearer tsk-not-a-key"}, code="invalid_api_key")


def test_models_need_a_key(client):
    response = client.get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_the_page_refuses_a_body_over_one_mebibyte(admin_client):
    response = admin_client.post("/api/chat/completions", json_body(**chat_body("x" * (1024 * 1024 + 10))), content_type="application/json")
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_the_page_refuses_a_request_no_worker_can_serve(admin_client, settings, redis_client):
    settings.TOKSTREAM_REDIS_PREFIX = "tokstream-test-no-workers-here"
    response = admin_client.post("/api/chat/completions", json_body(**chat_body("hi")), content_type="application/json")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_unavailable"
    assert not list(redis_client.scan_iter(match="tokstream-test-no-workers-here:*"))
