"""Upstream models: a front service relays an OpenAI-compatible upstream into its own stream
and ledger. Here the upstream is the live service (the real model behind a real server), or a
small vendor stand-in that misreports its usage, refuses or hangs; llama.cpp's own server is
tests/test_upstream_llama_cpp.py's (the fixtures: tests/upstreams.py)."""

import threading
import time

import httpx
import pytest

from billing.models import ApiKey, UsageEntry, hash_key
from inference.worker import slots
from tests.service import wait_for_entry
from tests.sse import MODEL, auth, chat_body, content_of, events
from tests.test_chat_page import REPLY, chat_page
from tests.upstreams import REPORTED, UPSTREAM_KEY, VendorStandIn
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def upstream_key(transactional_db):
    """The key the front's worker presents to the live service (each test's database is new)."""
    ApiKey.objects.create(name="upstream", prefix=UPSTREAM_KEY[:12], key_hash=hash_key(UPSTREAM_KEY))


def stream(service, api_key, body, on_comment=None):
    url = f"{service.url}/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}, headers=auth(api_key), timeout=120) as response:
        assert response.status_code == 200, response.read()
        return list(events(response, on_comment))


def test_a_relayed_stream_arrives_as_a_local_one_and_both_counts_agree(front, live_service, api_key, upstream_key):
    body = chat_body("Name three colours.", model="relayed", max_tokens=12, temperature=0)
    streamed = [data for _, data in stream(front, api_key, body)]
    assert streamed[-1] == "[DONE]" and streamed[-2]["choices"] == []
    entry = UsageEntry.objects.get(request_id=streamed[0]["id"])
    # What the upstream wrote for this very request, replayed from its own log (a second
    # greedy request need not repeat it in a reduced weight format: README, "Weight formats").
    url = f"{live_service.url}/v1/chat/completions/{entry.vendor_request_id}/events"
    with httpx.stream("GET", url, headers=auth(UPSTREAM_KEY), timeout=30) as response:
        upstream = [data for _, data in events(response)]
    assert content_of(streamed[:-1]) == content_of(upstream[:-1])
    assert entry.model == "relayed" and entry.model_served == MODEL and entry.usage_source == "upstream"
    assert (entry.prompt_tokens, entry.completion_tokens) == (entry.vendor_prompt_tokens, entry.vendor_completion_tokens)
    theirs = UsageEntry.objects.get(request_id=entry.vendor_request_id)  # the upstream's own ledger (the same database here)
    assert (entry.prompt_tokens, entry.completion_tokens) == (theirs.prompt_tokens, theirs.completion_tokens)
    assert (entry.counted_prompt_tokens, entry.counted_completion_tokens) == (entry.prompt_tokens, entry.completion_tokens)
    assert entry.counts_differ is False
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


def test_an_upstream_that_reports_other_counts_is_billed_its_counts_and_flagged(front, api_key):
    body = chat_body("Say hello.", model="vendor")
    counted = httpx.post(f"{front.url}/v1/tokenize", json=body, headers=auth(api_key), timeout=30).json()
    streamed = [data for _, data in stream(front, api_key, body)]
    assert content_of(streamed[:-1]) == "Hello there"
    assert streamed[-2]["usage"] == REPORTED  # the client is told what it will be billed
    entry = UsageEntry.objects.get(request_id=streamed[0]["id"])
    assert entry.usage_source == "upstream" and entry.counts_differ is True
    assert (entry.prompt_tokens, entry.completion_tokens) == (999, 2) == (entry.vendor_prompt_tokens, entry.vendor_completion_tokens)
    assert entry.counted_prompt_tokens == counted["prompt_tokens"] != 999
    assert entry.counted_completion_tokens == 2 and entry.tokenizer == "o200k_base"


@pytest.mark.parametrize("stream_it", [True, False])
@pytest.mark.parametrize("refusal", ["busy", "overloaded", "missing"])
def test_an_upstream_refusal_reaches_the_client_with_its_own_status(front, api_key, stream_it, refusal):
    status, error, headers = VendorStandIn.REFUSALS[refusal]
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=chat_body(refusal, model="vendor", stream=stream_it), headers=auth(api_key), timeout=60)
    assert answer.status_code == status and answer.headers.get("retry-after") == headers.get("Retry-After")
    told = answer.json()["error"]
    assert (told["code"], told["type"]) == (error["code"], error["type"])
    assert told["message"] == f"the upstream answered {status}: {error['message']}"
    entry = wait_for_entry(seconds=10, model="vendor")
    assert entry.status == "failed" and entry.prompt_tokens == 0  # the vendor never took it: nothing billed


def test_an_upstream_failure_before_its_first_byte_is_a_500_not_a_stream(front, api_key):
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=chat_body("fail", model="vendor", stream=True), headers=auth(api_key), timeout=60)
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/json"
    assert answer.json()["error"]["message"] == "the upstream answered 500: the vendor is down"
    assert wait_for_entry(seconds=10, model="vendor").status == "failed"


def test_an_upstream_that_does_not_answer_in_time_is_a_504(front, api_key):
    started = time.monotonic()
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=chat_body("hang", model="vendor", stream=True), headers=auth(api_key), timeout=60)
    assert time.monotonic() - started < 4.5  # the vendor's 5 s sleep was not waited out
    assert answer.status_code == 504 and answer.json()["error"]["message"] == "the upstream did not answer in time"
    assert wait_for_entry(seconds=10, model="vendor").status == "failed"


def test_the_chat_page_streams_an_upstream_model(front, new_page):
    browser = chat_page(new_page, front.url)
    browser.send("Say hello.", model="vendor")
    browser.wait_until_done()
    assert browser.page.get_attribute(REPLY, "data-text") == "Hello there"
    browser.page.wait_for_selector(f"{REPLY} .meta .usage")
    entry = UsageEntry.objects.get(model="vendor")
    assert browser.page.text_content(f"{REPLY} .meta .usage").startswith(f"{entry.prompt_tokens} prompt + 2 completion")


def test_the_chat_page_marks_a_reply_whose_upstream_failed_also_after_a_reload(front, new_page):
    browser = chat_page(new_page, front.url)
    browser.send("fail", model="vendor")
    browser.wait_until_done()
    mark = "Failed: the upstream answered 500: the vendor is down"
    page = browser.page
    page.wait_for_selector(f"{REPLY} .meta .ending")
    assert page.text_content(f"{REPLY} .meta .ending") == mark
    page.reload()
    page.wait_for_selector(f"{REPLY} .meta .ending")
    assert page.text_content(f"{REPLY} .meta .ending") == mark


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


def test_a_client_that_leaves_while_the_upstream_is_silent_cuts_the_upstream_connection(front, api_key):
    """A long prefill sends no byte: the cut reaches the upstream at once all the same, and the
    prompt it read is billed."""
    VendorStandIn.left.clear()
    body = chat_body("silent 30", model="vendor-slow", stream=True)
    with pytest.raises(httpx.ReadTimeout):  # the status line waits for the upstream's answer (or the first keep-alive)
        httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=httpx.Timeout(10, read=2))
    left = time.monotonic()
    eventually(lambda: VendorStandIn.left, 5, message="the upstream's connection stayed open")
    assert VendorStandIn.left[0] - left < 3
    entry = wait_for_entry(seconds=10, model="vendor-slow")
    assert entry.status == "cancelled" and entry.usage_source == "estimate"
    assert entry.prompt_tokens == entry.counted_prompt_tokens > 0 and entry.completion_tokens == 0


def test_a_request_waiting_for_a_one_slot_upstream_gets_keep_alives_and_the_slot_outlasts_its_lease(front, api_key):
    """The first request's upstream says nothing for longer than a slot's lease (as shipped): the
    lease is renewed while the relay waits for the answer, so the second request, which waits
    in our queue meanwhile with its stream open and keep-alives (every 15 s, as shipped), is not
    sent to the one-slot server before the first is done."""
    VendorStandIn.most_in_flight = VendorStandIn.in_flight
    first = threading.Thread(target=stream, args=(front, api_key, chat_body(f"silent {slots.LEASE_SECONDS + 3}", model="vendor-slow")))
    first.start()
    try:
        eventually(lambda: VendorStandIn.in_flight == 1, 10, message="the first request never reached the upstream")
        comments = []
        second = [
            data
            for _, data in stream(front, api_key, chat_body("Say hello.", model="vendor-slow"), on_comment=lambda: comments.append(VendorStandIn.in_flight))
        ]
    finally:
        first.join()
    assert content_of(second[:-1]) == "Hello there" and second[0]["tokstream"]["queue_position"] == 0
    assert len(comments) >= 2 and set(comments) == {1}  # keep-alives while only the first was at the upstream
    assert VendorStandIn.most_in_flight == 1


def test_an_error_chunk_before_the_finish_reason_fails_the_request(front, api_key):
    streamed = [data for _, data in stream(front, api_key, chat_body("error then stop", model="vendor"))]
    assert [data["error"]["message"] for data in streamed[:-1] if "error" in data] == ["the upstream failed: the vendor lost its model"]
    entry = wait_for_entry(seconds=10, model="vendor")
    assert entry.status == "failed" and entry.error == "the upstream failed: the vendor lost its model"


def test_usage_that_is_not_numbers_is_no_bill_and_the_request_still_ends(front, api_key):
    streamed = [data for _, data in stream(front, api_key, chat_body("bad usage", model="vendor"))]
    assert streamed[-1] == "[DONE]" and content_of(streamed[:-1]) == "Hello there"
    entry = wait_for_entry(seconds=10, model="vendor")
    assert entry.status == "completed" and entry.usage_source == "estimate" and entry.counts_differ is None
    billed = (entry.prompt_tokens, entry.completion_tokens)
    assert billed == (entry.counted_prompt_tokens, entry.counted_completion_tokens) == (streamed[-2]["usage"]["prompt_tokens"], 2)


def test_a_field_whose_answer_a_relay_would_lose_is_refused_by_name(front, api_key):
    body = chat_body("Say hello.", model="vendor", functions=[{"name": "f", "parameters": {}}])
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "functions"
    assert not UsageEntry.objects.exists()


def test_a_reply_whose_finish_reason_came_before_its_client_left_is_billed_whole(front, api_key):
    """The upstream sent the whole reply and its finish reason, then nothing for a while before
    its usage, and the client left meanwhile: the reply was whole, so it is billed as completed
    (by our count: the vendor's usage was lost with the connection), not as cancelled."""
    body = chat_body("stop then silent", model="vendor-slow", stream=True)
    with httpx.stream("POST", f"{front.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=60) as response:
        seen = []
        for _, data in events(response):
            seen.append(data)
            if content_of(seen) == "Hello there":
                break  # the client leaves (the finish reason reaches clients with the usage, at the end)
    entry = wait_for_entry(seconds=10, model="vendor-slow")
    assert entry.status == "completed" and entry.usage_source == "estimate" and entry.completion_tokens == 2
