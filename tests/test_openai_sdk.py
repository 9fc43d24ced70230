"""The official openai package, pointed at tokstream, works unchanged."""

import json

import openai
import pytest

from billing.models import ApiKey
from tests.sse import MODEL

pytestmark = pytest.mark.django_db(transaction=True)
MESSAGES = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture
def client(live_service, api_key):
    return openai.OpenAI(base_url=f"{live_service.url}/v1", api_key=api_key, max_retries=0)


def test_it_lists_the_models(client):
    assert [model.id for model in client.models.list()] == ["echo", MODEL]


def test_whole_and_streamed_completions_agree_choice_by_choice(client):
    options = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0.8, seed=11, n=2, stop=["\n\n\n"], logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**options)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in whole.choices)
    assert all(len(c.logprobs.content[0].top_logprobs) == 2 for c in whole.choices)
    texts, usage = {0: "", 1: ""}, None
    for chunk in client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_the_stream_helper_accumulates_the_reply(client):
    hello = [{"role": "user", "content": "Say hello in one short sentence."}]
    with client.chat.completions.stream(model=MODEL, messages=hello, max_tokens=60, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "".join(deltas) and len(deltas) > 2


def test_errors_surface_as_the_sdks_own_exceptions(client, live_service):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="tsk-wrong", max_retries=0).models.list()
    key, raw = ApiKey.issue("no requests at all")
    ApiKey.objects.filter(pk=key.pk).update(requests_per_minute=0)
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=client.base_url, api_key=raw, max_retries=0).chat.completions.create(model=MODEL, messages=MESSAGES)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def earlier_call(city, n):
    arguments = json.dumps({"city": city})
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"call_{n}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
    }


# Two earlier calls show this small model the convention; it then follows it for Paris.
TOOL_MESSAGES = [
    {"role": "user", "content": "What is the weather in Rome?"},
    earlier_call("Rome", 1),
    {"role": "user", "content": "What is the weather in Oslo?"},
    earlier_call("Oslo", 2),
    {"role": "user", "content": "What is the weather in Paris?"},
]


def test_tool_calls_stream_as_openai_streams_them(client):
    options = dict(model=MODEL, messages=TOOL_MESSAGES, tools=[WEATHER], max_tokens=60, temperature=0)
    chunks = list(client.chat.completions.create(**options, stream=True))
    calls = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]
    first, rest = calls[0], calls[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_weather", "")
    assert first.id.startswith("call_")
    assert rest and all(c.index == 0 and c.id is None and c.function.name is None for c in rest)
    assert json.loads("".join(c.function.arguments for c in rest)) == {"city": "Paris"}
    assert "<tool_call>" not in "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = client.chat.completions.create(**options)
    [call] = whole.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None


def test_the_stream_helper_accumulates_a_valid_call(client):
    with client.chat.completions.stream(model=MODEL, messages=TOOL_MESSAGES, tools=[WEATHER], max_tokens=60, temperature=0) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [json.loads(event.arguments) for event in done] == [{"city": "Paris"}]
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"
