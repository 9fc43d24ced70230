"""The relay against a real OpenAI-compatible server that nobody here wrote: llama.cpp's own
llama-server on the shipped GGUF, one slot (tests/upstreams.py), behind a proxy that changes
nothing unless a test asks it to. Requests are greedy, so llama.cpp asked directly answers the
same text."""

import csv
import io
import threading
import time

import httpx
import pytest
from django.conf import settings

from billing import invoices
from billing.models import UsageEntry
from tests.service import wait_for_entry
from tests.sse import auth, chat_body, content_of, events
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# Plain, cut at stop strings, and with tools (with a call and its result in the history too).
REQUESTS = [
    {"content": "Name three colours."},
    {"content": "Write a haiku about tea. 🍵"},
    {"content": "Say hello in Japanese: こんにちは means?"},
    {"content": "What is 2 + 2? Answer in one word."},
    {"content": "Count from one to ten in words, separated by commas.", "stop": [","]},
    {"content": "List three fruits, one per line.", "stop": ["\n"]},
    {"content": "Write two sentences about rain.", "stop": [".", "!"]},
    {"content": "What is the weather in Paris?", "tools": [WEATHER]},
    {"content": "Use a tool to get the weather in Rome.", "tools": [WEATHER], "tool_choice": "auto"},
    {"history": True, "tools": [WEATHER]},
]


def llama_body(request, **extra):
    content = request.get("content", "Thanks. And in Oslo?")
    body = chat_body(content, model="llama", **{"temperature": 0, "max_tokens": 40, **extra})
    body.update({key: value for key, value in request.items() if key not in ("content", "history")})
    if request.get("history"):
        body["messages"][:0] = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},  # a tool-call turn: null content, as OpenAI's SDK sends it
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
        ]
    return body


def stream(service, api_key, body, on_comment=None):
    """(the status, the events) of a streamed request with usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=180) as response:
        if response.status_code != 200:
            return response.status_code, response.read()
        return 200, [data for _, data in events(response, on_comment)]


def direct(llama_server, body):
    """The same request, asked of llama.cpp itself: its text and its usage."""
    body = {**body, "model": "smollm2", "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{llama_server.url}/v1/chat/completions", json=body, timeout=180) as response:
        chunks = [data for _, data in events(response)]
    return content_of(chunks[:-1]), chunks[-2]["usage"]


def invoice_of(usages):
    """A per-request usage export made from llama.cpp's own counts, as a vendor would send it."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["request_id", "model", "input_tokens", "input_cached_tokens", "output_tokens"])
    for usage in usages:
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        writer.writerow([usage["id"], "smollm2", usage["prompt_tokens"], cached, usage["completion_tokens"]])
    return out.getvalue().encode()


def test_ten_greedy_requests_are_billed_as_llama_cpp_counts_them(front, llama_server, watched, api_key):
    entries = []
    for request in REQUESTS:
        body = llama_body(request)
        status, streamed = stream(front, api_key, body)
        assert status == 200, streamed
        text, _ = direct(llama_server, body)
        assert content_of(streamed[:-1]) == text  # byte for byte, emoji and CJK included
        entry = wait_for_entry(seconds=30, request_id=streamed[0]["id"])
        usage = watched.usages[-1]  # llama.cpp's usage of the relayed request, as it streamed it
        assert entry.usage_source == "upstream" and entry.vendor_request_id == usage["id"]
        assert (entry.prompt_tokens, entry.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert streamed[-2]["usage"]["completion_tokens"] == usage["completion_tokens"]  # the client is told what is billed
        entries.append(entry)
    invoice, _ = invoices.import_invoice("openai", "llama.csv", invoice_of(watched.usages))
    outcomes = invoices.reconcile(invoice)
    assert [o.status for o in outcomes] == ["matched"] * len(REQUESTS)
    # Our own count, beside the bill: the model's template (which drops tools, as llama.cpp
    # does), the end-of-turn token llama-server counts, the stop string it cut.
    ours = [(e.counted_prompt_tokens, e.counted_completion_tokens) for e in entries]
    assert ours == [(e.prompt_tokens, e.completion_tokens) for e in entries] and not any(e.counts_differ for e in entries)


def test_without_usage_from_the_upstream_every_entry_is_an_estimate(front, watched, api_key):
    watched.strip_usage = True  # as llama-cpp-python's server streams: no usage at all
    for request in REQUESTS:
        status, streamed = stream(front, api_key, llama_body(request))
        assert status == 200, streamed
        entry = wait_for_entry(seconds=30, request_id=streamed[0]["id"])
        assert entry.usage_source == "estimate" and entry.counts_differ is None
        assert entry.vendor_prompt_tokens is None and entry.vendor_completion_tokens is None
        assert (entry.prompt_tokens, entry.completion_tokens) == (entry.counted_prompt_tokens, entry.counted_completion_tokens)
        assert streamed[-2]["usage"]["completion_tokens"] == entry.completion_tokens
    exported = httpx.get(f"{front.url}/api/ledger/entries/", params={"counts_differ": "unknown"}, headers=auth(ledger_key()), timeout=30).json()
    assert {e["usage_source"] for e in exported["results"]} == {"estimate"} and len(exported["results"]) == len(REQUESTS)


def ledger_key():
    from billing.models import ApiKey

    return ApiKey.issue("auditor", scopes="ledger:read:all")[1]


def test_a_relayed_request_carries_only_what_the_client_sent(front, watched, api_key):
    # top_k is vLLM's and llama.cpp's, response_format OpenAI's that we do not read ourselves: both go as sent.
    body = llama_body(REQUESTS[-1], seed=7, top_k=1, response_format={"type": "text"})
    status, streamed = stream(front, api_key, body)
    assert status == 200, streamed  # llama.cpp took the tool-call turn as forwarded
    sent = watched.bodies[-1]
    client_fields = set(body) | {"stream", "stream_options"}
    assert set(sent) == client_fields and sent["model"] == "smollm2" and sent["stream_options"] == {"include_usage": True}
    assert sent["top_k"] == 1 and sent["seed"] == 7 and sent["tools"] == [WEATHER] and sent["response_format"] == {"type": "text"}
    assert sent["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert sent["messages"][2:] == body["messages"][2:]


def test_what_cannot_be_forwarded_is_refused_by_name(front, watched, api_key):
    body = llama_body(REQUESTS[-1])
    del body["messages"][2]["tool_call_id"]
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages.[2].tool_call_id"
    assert watched.bodies == [] and not UsageEntry.objects.exists()


@pytest.mark.parametrize("stream_it", [True, False])
def test_a_refusal_by_llama_cpp_keeps_its_status(front, watched, api_key, stream_it):
    body = chat_body("tea " * 3000, model="llama", max_tokens=8, stream=stream_it)  # more than llama.cpp's 2048-token window
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=60)
    assert answer.status_code == 400 and answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["message"].startswith("the upstream answered 400: ") and "context" in error["message"]
    entry = wait_for_entry(seconds=30, model="llama")
    assert entry.status == "failed" and entry.prompt_tokens == 0


def test_a_stream_cut_after_its_first_byte_ends_with_an_error_event_and_is_billed(front, watched, api_key):
    watched.cut_after = 5
    status, streamed = stream(front, api_key, llama_body({"content": "Write a long story about a lighthouse."}, max_tokens=200))
    assert status == 200 and streamed[-1] == "[DONE]"
    errors = [data["error"] for data in streamed[:-1] if "error" in data]
    assert [e["message"] for e in errors] == ["the upstream stream ended without a finish reason"]  # the proxy closed it mid-answer
    entry = wait_for_entry(seconds=30, request_id=streamed[0]["id"])
    assert entry.status == "failed" and entry.usage_source == "estimate" and 0 < entry.completion_tokens < 200


def test_one_slot_upstream_is_sent_one_request_at_a_time_and_none_is_interrupted(front, watched, api_key):
    bodies = [llama_body({"content": f"Write a short poem about the number {n}."}, max_tokens=60) for n in range(3)]
    results = [None] * 3

    def run(n):
        results[n] = stream(front, api_key, bodies[n])

    threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert watched.most_in_flight == 1
    for status, streamed in results:
        assert status == 200 and streamed[-3]["choices"][0]["finish_reason"] in ("stop", "length")
    assert {e.status for e in UsageEntry.objects.all()} <= {"completed", "length"}


def test_cancelling_closes_the_upstream_request(front, watched, api_key):
    body = {**llama_body({"content": "Write a very long story about a lighthouse keeper."}, max_tokens=400), "stream": True}
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120) as response:
        for count, _ in enumerate(events(response)):
            if count == 6:
                break  # the client leaves
    entry = wait_for_entry(seconds=30, model="llama")
    assert entry.status == "cancelled" and 0 < entry.completion_tokens < 400
    eventually(lambda: watched.in_flight == 0, 5, message="the upstream request stayed open")


def test_tokenize_counts_a_tool_prompt_with_the_models_own_template(front, api_key):
    body = llama_body(REQUESTS[-1])
    counted = httpx.post(f"{front.url}/v1/tokenize", json=body, headers=auth(api_key), timeout=30).json()
    from inference import registry

    template = registry.tokenizer("smollm2-135m-instruct").apply_chat_template
    messages = [{**m, "content": m["content"] or ""} for m in body["messages"]]
    assert counted["prompt_tokens"] == len(template(messages, tools=body["tools"], add_generation_prompt=True, tokenize=True))
    assert counted["estimate"] is True  # the upstream's usage will be the bill


def test_a_client_that_set_no_max_tokens_gets_ours_without_the_upstream_being_told(front, watched, api_key):
    body = chat_body("Write a 2000-word essay about the history of tea.", model="llama-narrow", temperature=0)
    counted = httpx.post(f"{front.url}/v1/tokenize", json=body, headers=auth(api_key), timeout=30).json()
    status, streamed = stream(front, api_key, body)
    assert status == 200 and "max_tokens" not in watched.bodies[-1]
    assert streamed[-3]["choices"][0]["finish_reason"] == "length"
    entry = wait_for_entry(seconds=30, request_id=streamed[0]["id"])
    assert entry.status == "length" and counted["max_tokens"] <= entry.completion_tokens <= counted["max_tokens"] + 2
    eventually(lambda: watched.in_flight == 0, 5, message="the upstream request stayed open")


def test_an_upstream_silent_for_seconds_before_its_first_token_keeps_the_stream_alive(front, watched, api_key):
    """A prompt near llama.cpp's whole window: one thread reads it for several seconds (16 s
    where it was measured), longer than redis-py's default 5 s time-out, with the shipped
    keep-alive interval."""
    body = llama_body({"content": "coffee " * 1900}, max_tokens=4)
    arrivals = []
    started = time.monotonic()
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", json={**body, "stream": True}, headers=auth(api_key), timeout=120) as response:
        lines = [(arrivals.append(time.monotonic()), line)[1] for line in response.iter_lines() if line]
    replied = next(t for t, line in zip(arrivals, lines) if line.startswith("data: {") and "queue_position" not in line)
    assert replied - started > 5, lines  # it was silent for longer than a socket time-out
    gaps = [later - earlier for earlier, later in zip([started, *arrivals], arrivals)]
    assert max(gaps) < settings.TOKSTREAM_KEEPALIVE_SECONDS + 3 and lines[-1] == "data: [DONE]"
    entry = wait_for_entry(seconds=30, model="llama")
    assert entry.status in ("completed", "length") and entry.prompt_tokens > 1900


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_is_forwarded_as_sent_and_its_answer_relayed_and_billed(front, watched, llama_server, api_key, choice):
    # This llama-server takes a forced choice (200) but, with SmolLM2's template, answers in
    # text: what it answers is relayed as it answers it directly, and billed as it counts.
    body = llama_body({"content": "What is the weather in Oslo?", "tools": [WEATHER], "tool_choice": choice}, max_tokens=40)
    status, streamed = stream(front, api_key, body)
    assert status == 200, streamed
    assert watched.bodies[-1]["tool_choice"] == choice and watched.bodies[-1]["tools"] == [WEATHER]
    text, _ = direct(llama_server, body)
    assert content_of(streamed[:-1]) == text
    entry = wait_for_entry(seconds=30, request_id=streamed[0]["id"])
    usage = watched.usages[-1]
    assert entry.usage_source == "upstream" and (entry.prompt_tokens, entry.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])


def test_a_forced_tool_choice_is_refused_for_a_local_model_and_without_tools(front, api_key):
    local = chat_body("Weather?", tools=[WEATHER], tool_choice="required")
    for body, why in ((local, "upstream models only"), ({**llama_body({"content": "Hi"}), "tool_choice": "required"}, "needs `tools`")):
        answer = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice" and why in answer.json()["error"]["message"]
    assert not UsageEntry.objects.exists()
