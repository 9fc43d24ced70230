"""A deterministic fuzz of POST /v1/chat/completions and /v1/tokenize: a hostile body gets a
4xx in the OpenAI error shape, never a 5xx, and leaves nothing behind; an accepted one runs to
its end without failing. Only that last needs the live service: a refusal is answered in this
process, by the parser or by the apps themselves."""

import copy
import json
import os
import random
import time

import httpx
import pytest

from billing.models import UsageEntry
from inference.backends import CATALOG
from inference.gateway import prompt_count, views
from inference.protocol import chat_request
from inference.protocol.errors import ApiError
from tests import asgi
from tests.sse import MODEL, auth, chat_body, events

SEED = 20240612
CASES = 240
CHAT, TOKENIZE = "/v1/chat/completions", "/v1/tokenize"
DELETE = object()  # a mutation that removes the field
NAN, INF = float("nan"), float("inf")
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


# Wrong in type, range or encoding for most fields; json.dumps writes NaN and escapes surrogates.
HOSTILE = [
    None, True, False, 0, -1, 1.5, -0.0, 2**64, -(2**64), 10**30, 1e308, -1e308, NAN, INF, -INF,
    "", " ", "x", "\x00", "²", "①", "\ud800", "\udfff tail", "<|im_end|>", "word " * 300,
    [], [None], [1], ["x"], [[]], [{}], {}, {"a": 1}, {"\ud800": 1}, {"type": "text"}, {"type": "text", "text": 1},
    {"role": "user", "content": "hi"}, nested(30), nested(80),
]  # fmt: skip
# Almost right, by the name of the field mutated.
NEAR = {
    "role": ["developer", "tool", "assistant", "wizard", "USER"],
    "type": ["function", "image_url", "text"],
    "stop": [["a"] * 5, ["a", 1], "\n", [""]],
    "logit_bias": [{"²": 1}, {"①": 1}, {"9" * 5000: 1}, {"-1": 1}, {"0": NAN}, {"00": -100}, {"1": True}, {"999999": 1}],
    "tool_choice": ["required", "none", {"type": "function", "function": {"name": "get_weather"}}],
    "name": ["get weather", "get_weather\n", "a" * 65, 5],
    # Too deep to show as JSON; the parser's own test has one too deep to parse (a prompt of 2,500 tokens).
    "arguments": ["[" * 70 + "]" * 70, "{", '{"x": NaN}', {"city": "Oslo"}],
    "beam_width": [2, 8, 9, True],
    "n": [2, 16, 17, 1.0],
    "seed": [2**64, -(2**63), 2**63 - 1],
    "top_logprobs": [0, 20, 21],
}
PATHS = [
    ("model",), ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
    ("messages", 1, "content"), ("messages", 1, "content", 0), ("messages", 1, "content", 0, "type"),
    ("messages", 1, "content", 0, "text"), ("messages", 1, "name"), ("messages", 1, "surprise"),
    ("messages", 2, "tool_calls"), ("messages", 2, "tool_calls", 0), ("messages", 2, "tool_calls", 0, "function"),
    ("messages", 2, "tool_calls", 0, "function", "name"), ("messages", 2, "tool_calls", 0, "function", "arguments"),
    ("messages", 3, "tool_call_id"), ("stream",), ("stream_options",), ("stream_options", "include_usage"),
    ("stream_options", "continuous_usage_stats"), ("stream_options", "surprise"), ("max_tokens",),
    ("max_completion_tokens",), ("n",), ("temperature",), ("top_p",), ("top_k",), ("min_p",),
    ("presence_penalty",), ("frequency_penalty",), ("repetition_penalty",), ("logit_bias",), ("logit_bias", "42"),
    ("seed",), ("stop",), ("stop", 0), ("logprobs",), ("top_logprobs",), ("tools",), ("tools", 0), ("tools", 0, "type"),
    ("tools", 0, "function"), ("tools", 0, "function", "name"), ("tools", 0, "function", "description"),
    ("tools", 0, "function", "parameters"), ("tools", 0, "function", "surprise"), ("tool_choice",), ("tokstream",),
    ("tokstream", "beam_width"), ("tokstream", "detach_on_disconnect"), ("user",), ("response_format",), ("surprise",),
]  # fmt: skip


def valid_body(stream):
    """Every field the parser reads, valid, so that each mutation reaches its check."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "The weather in Oslo?"}]},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
        ],
        "stream": stream,
        # Both: a case spoils one at most, so an accepted case still stops after one token.
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05,
        "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1,
        "logit_bias": {"42": 1}, "seed": 7, "stop": ["\n\n"], "logprobs": True, "top_logprobs": 2,
        "tools": [TOOL], "tool_choice": "auto",
        "tokstream": {"beam_width": 1, "detach_on_disconnect": False},
    }  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": False}
    return body


def mutated(body, path, value):
    body = copy.deepcopy(body)
    parent = body
    for step in path[:-1]:  # stream_options is not in a body that does not stream: make it
        parent = parent[step] if isinstance(parent, list) else parent.setdefault(step, {})
    if value is DELETE and isinstance(parent, list):
        del parent[path[-1]]
    elif value is DELETE:
        parent.pop(path[-1], None)
    else:
        parent[path[-1]] = value
    return body


def fuzz_cases():
    """(stream, path, value), the same every run."""
    rng = random.Random(SEED)
    for _ in range(CASES):
        path = rng.choice(PATHS)
        near = NEAR.get(path[-1])
        value = rng.choice(near) if near and rng.random() < 0.4 else rng.choice([*HOSTILE, DELETE])
        yield rng.random() < 0.5, path, value


def raw_body(field, raw):
    """A chat body whose `field` is the JSON text `raw`, which json.dumps could not write."""
    return json.dumps(chat_body("hi", max_tokens=1, **{field: "@RAW@"})).replace('"@RAW@"', raw).encode()


def chat_with(**fields):
    return json.dumps(chat_body("hi", max_tokens=1, **fields)).encode()


def message_with(**fields):
    return chat_with(messages=[{"role": "user", "content": "hi", **fields}])


# The triggers: most were a 500, or passed the checks and failed in generation.
TRIGGERS = {
    "role-list": (message_with(role=[]), "messages.[0].role"),
    "role-object": (message_with(role={}), "messages.[0].role"),
    "tools-number": (chat_with(tools=[1]), "tools"),
    "tools-string": (chat_with(tools=["x"]), "tools"),
    "tools-null": (chat_with(tools=[None]), "tools"),
    "logit-bias-superscript": (chat_with(logit_bias={"²": 1}), "logit_bias"),
    "logit-bias-circled": (chat_with(logit_bias={"①": 1}), "logit_bias"),
    "logit-bias-5000-digits": (chat_with(logit_bias={"9" * 5000: 1}), "logit_bias"),
    "lone-surrogate": (chat_with(messages=[{"role": "user", "content": "a\ud800b"}]), "messages.[0].content"),
    "lone-surrogate-in-a-part": (message_with(content=[{"type": "text", "text": "\udfff"}]), "messages.[0].content.[0].text"),
    "nul-in-a-stop": (chat_with(stop=["\x00"]), "stop.[0]"),
    "nested-5000-deep": (raw_body("user", "[" * 5000 + "]" * 5000), None),
    "integer-of-5000-digits": (raw_body("seed", "9" * 5000), None),
    "temperature-nan": (raw_body("temperature", "NaN"), "temperature"),
    "presence-penalty-infinity": (raw_body("presence_penalty", "Infinity"), "presence_penalty"),
    "frequency-penalty-minus-infinity": (raw_body("frequency_penalty", "-Infinity"), "frequency_penalty"),
    "repetition-penalty-nan": (raw_body("repetition_penalty", "NaN"), "repetition_penalty"),
    "top-p-nan": (raw_body("top_p", "NaN"), "top_p"),
    "min-p-nan": (raw_body("min_p", "NaN"), "min_p"),
    "nan-in-a-tool-schema": (chat_with(tools=[{**TOOL, "function": {**TOOL["function"], "parameters": {"x": NAN}}}]), "tools.[0].function.parameters.x"),
}


# -- the parser, without the service --------------------------------------------------------


@pytest.mark.parametrize("body,param", TRIGGERS.values(), ids=TRIGGERS.keys())
def test_it_refuses_each_trigger_with_a_400(body, param):
    with pytest.raises(ApiError) as refused:
        chat_request.parse(body, "application/json", CATALOG)
    assert (refused.value.status, refused.value.param) == (400, param)


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]}, "messages.[0].content"),
        ({"messages": ["hi"]}, "messages.[0].role"),
        ({"tools": [{**TOOL, "function": {**TOOL["function"], "name": "get_weather\n"}}]}, "tools"),
        ({"tools": [{**TOOL, "function": {**TOOL["function"], "name": 5}}]}, "tools"),
        ({"seed": 2**64}, "seed"),
        ({"user": nested(80)}, "user" + ".[0]" * 64),
        ({"tokstream": {"\ud800": 1}}, "tokstream"),
        ({"messages": [{"role": "user", "content": "a\x00b"}]}, "messages.[0].content"),
        # Falsy but of the wrong type: these were taken for "not given".
        ({"stream": True, "stream_options": False}, "stream_options"),
        ({"tokstream": []}, "tokstream"),
        ({"logit_bias": 0}, "logit_bias"),
        ({"tools": {}}, "tools"),
        ({"tool_choice": {}}, "tool_choice"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": {}}]}, "messages.[0].tool_calls"),
    ],
)
def test_it_refuses_other_holes_the_fuzz_found(fields, param):
    with pytest.raises(ApiError) as refused:
        chat_request.parse(chat_with(**fields), "application/json", CATALOG)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_it_keeps_arguments_too_deep_to_parse_as_text():
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}]
    chat = chat_request.parse(chat_with(messages=[{"role": "assistant", "content": "", "tool_calls": calls}]), "application/json", CATALOG)
    assert chat.messages[0]["tool_calls"] == [{"name": "f", "arguments": "[" * 5000}]


def test_it_still_takes_null_for_not_given():
    chat = chat_request.parse(chat_with(tools=None, tool_choice=None, logit_bias=None, tokstream=None, seed=None), "application/json", CATALOG)
    assert chat.tools == [] and chat.sampling.logit_bias == {} and chat.sampling.seed is None


@pytest.mark.parametrize("content", ["a\x00b", "\ud800", "[" * 5000])
def test_steering_refuses_text_it_cannot_keep(content):
    body = json.dumps({"content": content}).encode() if content[0] != "[" else content.encode()
    with pytest.raises(ApiError) as refused:
        views.steering_text(body)
    assert refused.value.status == 400


def test_the_fuzz_starts_from_bodies_the_parser_accepts():
    for stream in (True, False):
        chat = chat_request.parse(json.dumps(valid_body(stream)).encode(), "application/json", CATALOG)
        assert chat.max_tokens == 1 and chat.tools


def test_tokenize_answers_a_failure_of_ours_in_the_error_shape(client, api_key, monkeypatch):
    def broken(body, content_type):
        raise RuntimeError("a bug")

    monkeypatch.setattr(prompt_count, "tokenize", broken)
    response = client.post(TOKENIZE, chat_with(), content_type="application/json", headers=auth(api_key))
    assert response.status_code == 500 and error_shaped(response.json())


def test_tokenize_answers_a_body_too_large_in_the_error_shape(client, api_key):
    response = client.post(
        TOKENIZE, chat_with(messages=[{"role": "user", "content": "x" * (1024 * 1024 + 10)}]), content_type="application/json", headers=auth(api_key)
    )
    assert (response.status_code, response.json()["error"]["code"]) == (413, "request_too_large")


# -- the apps, in this process, and the live service ------------------------------------------


@pytest.fixture
def written(redis_client):
    """The ids of the requests that have Redis keys or a ledger row."""
    prefix = f"{os.environ['TOKSTREAM_REDIS_PREFIX']}:req:"

    def written():
        keys = {key[len(prefix) :].split(":")[0] for key in redis_client.scan_iter(match=f"{prefix}*")}
        return keys | set(UsageEntry.objects.values_list("request_id", flat=True))

    return written


def send(http, url, content):
    """(status, the body as JSON, or the events of a stream, or the text if neither)."""
    with http.stream("POST", url, content=content) as response:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return response.status_code, list(events(response))
        response.read()
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def check(http, written, accepted, url, content):
    """(status, answer, what is wrong with it) for one POST. Adds an accepted request's id to
    `accepted`: its keys and row are its own, not a refusal's."""
    before = written()
    status, answer = send(http, url, content)
    return status, answer, problems(written, before, accepted, url, status, answer)


def problems(written, before, accepted, url, status, answer):
    if status >= 500:
        return [f"{status}: {str(answer)[:300]}"]
    found = [] if status < 400 or error_shaped(answer) else [f"{status} not in the error shape: {str(answer)[:300]}"]
    if status < 400 and url == CHAT:
        found += ran_to_its_end(answer)
        accepted.update(request_ids(answer))
    if status >= 400 or url == TOKENIZE:  # counting writes nothing either
        left = written() - before - accepted
        found += [f"{status}, yet it wrote {sorted(left)}"] if left else []
    return found


def error_shaped(answer):
    error = answer.get("error") if isinstance(answer, dict) else None
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str) and error["message"] != ""


def ran_to_its_end(answer):
    if isinstance(answer, dict):
        return [] if answer.get("choices") else [f"200 without choices: {str(answer)[:300]}"]
    failed = [data for _, data in answer if isinstance(data, dict) and "error" in data]
    ended = bool(answer) and answer[-1][1] == "[DONE]"
    return ([f"the stream failed: {failed[0]}"] if failed else []) + ([] if ended else ["the stream did not end with [DONE]"])


def request_ids(answer):
    if isinstance(answer, dict):
        return {answer["id"]}
    return {data["id"] for _, data in answer if isinstance(data, dict) and "id" in data}


def rows_settled(ids, seconds=30):
    """The ledger rows of the accepted requests, once the workers have written them all."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rows = list(UsageEntry.objects.filter(request_id__in=ids))
        if len(rows) == len(ids):
            return rows
        time.sleep(0.2)
    return list(UsageEntry.objects.filter(request_id__in=ids))


def answered_here(client, api_key, url, content):
    """(status, the body as JSON) from the app that serves `url`: the chat endpoint's ASGI app,
    or the Django view of /v1/tokenize."""
    if url == CHAT:
        status, body = asgi.post_chat(content, {"Content-Type": "application/json", **auth(api_key)})
        return status, json.loads(body)
    response = client.post(url, content, content_type="application/json", headers=auth(api_key))
    return response.status_code, response.json()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("body,param", TRIGGERS.values(), ids=TRIGGERS.keys())
def test_each_trigger_gets_a_400_from_every_endpoint(client, api_key, written, body, param):
    streamed = body.replace(b'"max_tokens": 1', b'"max_tokens": 1, "stream": true')
    for url, content in [(CHAT, body), (CHAT, streamed), (TOKENIZE, body)]:
        before = written()
        status, answer = answered_here(client, api_key, url, content)
        assert problems(written, before, set(), url, status, answer) == []
        assert (status, answer["error"]["param"]) == (400, param)


@pytest.fixture
def http(live_service, api_key):
    with httpx.Client(base_url=live_service.url, headers={"Content-Type": "application/json", **auth(api_key)}, timeout=60) as client:
        yield client


@pytest.mark.django_db(transaction=True)
def test_no_mutation_of_a_valid_body_gets_a_5xx_or_leaves_a_refusal_behind(http, written):
    accepted, found = set(), []
    for stream in (True, False):
        status, _, found = check(http, written, accepted, CHAT, json.dumps(valid_body(stream)).encode())
        assert (status, found) == (200, [])
    for number, (stream, path, value) in enumerate(fuzz_cases()):
        content = json.dumps(mutated(valid_body(stream), path, value)).encode()
        for url in (CHAT, TOKENIZE):
            case = f"case {number}: {url} stream={stream} {'.'.join(map(str, path))} = {'(deleted)' if value is DELETE else repr(value)[:80]}"
            found += [f"{case}: {problem}" for problem in check(http, written, accepted, url, content)[2]]
    rows = rows_settled(accepted)
    assert len(rows) == len(accepted), "some accepted requests left no ledger row"
    found += [f"{row.request_id} failed: {row.error}" for row in rows if row.status == UsageEntry.Status.FAILED]
    assert found == [], "\n".join(found)
