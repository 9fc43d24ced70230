"""End to end with the real model: Daphne, a Celery worker, Redis and the database."""

import httpx
import pytest

from billing.models import UsageEntry, hash_key
from inference.worker import engines
from inference.worker.engine import Request, SamplingParams
from tests.service import wait_for_entry
from tests.sse import MODEL, auth, chat_body, content_of, events, stream_chat

pytestmark = pytest.mark.django_db(transaction=True)
PROMPT = "List three facts about the Moon."


def test_it_streams_what_the_whole_completion_says(live_service, api_key):
    body = chat_body(PROMPT, temperature=0, max_tokens=40)
    whole = httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120).json()
    streamed = stream_chat(live_service, api_key, {**body, "stream": True})
    chunks = [data for _, data in streamed[:-1]]
    assert content_of(chunks) == whole["choices"][0]["message"]["content"]
    assert len([c for c in chunks if c["choices"][0]["delta"].get("content")]) > 3  # it really streamed
    assert whole["object"] == "chat.completion"
    assert whole["usage"]["completion_tokens"] <= 40


def test_chunks_follow_the_openai_stream_shape(live_service, api_key):
    streamed = stream_chat(live_service, api_key, chat_body(PROMPT, temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1][1] == "[DONE]"
    chunks = [data for _, data in streamed[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])
    ids = [event_id for event_id, _ in streamed]
    assert all(ids) and len(set(ids)) == len(ids)
    assert ids == sorted(ids, key=event_order)


def test_the_stream_opens_with_a_retry_hint_and_the_sse_headers(live_service, api_key):
    body = chat_body("Hi", max_tokens=3, stream=True)
    with httpx.stream("POST", f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=60) as response:
        raw = response.read().decode()
    # On the first event (the openai SDK chokes on a lone retry): the shipped 10 s grace
    # before an abandoned request stops, halved, at most 3 s.
    assert raw.startswith("retry: 3000\nid: ")
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    assert response.headers["x-request-id"].startswith("chatcmpl-") and response.headers["x-request-id"] in raw
    assert raw.endswith("data: [DONE]\n\n")


def event_order(event_id):
    entry, _, part = event_id.partition(".")
    ms, seq = entry.split("-")
    return int(ms), int(seq), int(part) if part else float("inf")


def test_continuous_usage_counts_every_token_as_it_comes(live_service, api_key):
    options = {"include_usage": True, "continuous_usage_stats": True}
    streamed = stream_chat(live_service, api_key, chat_body(PROMPT, temperature=0, max_tokens=16, stream=True, stream_options=options))
    chunks = [data for _, data in streamed[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert counts == sorted(counts) and len(set(counts)) == len(counts) > 3
    final = chunks[-1]["usage"]
    assert counts[-1] <= final["completion_tokens"] == 16
    assert {c["usage"]["prompt_tokens"] for c in chunks if c["usage"]} == {final["prompt_tokens"]}


def test_the_usage_chunk_equals_the_ledger_entry(live_service, api_key, tokenizer):
    body = chat_body("Say hello.", temperature=0, max_tokens=30, stream=True)
    streamed = stream_chat(live_service, api_key, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    usage_chunk = streamed[-2][1]
    entry = UsageEntry.objects.get(request_id=usage_chunk["id"])
    assert usage_chunk["usage"] == {
        "prompt_tokens": entry.prompt_tokens,
        "completion_tokens": entry.completion_tokens,
        "total_tokens": entry.prompt_tokens + entry.completion_tokens,
    }
    # Tokenizer-exact: the ids of the chat template, and one id per decode step.
    assert entry.prompt_tokens == len(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True))
    last_delta = [c for _, c in streamed[:-2] if c["choices"] and c["choices"][0]["delta"].get("content")][-1]
    finish = streamed[-3][1]["choices"][0]["finish_reason"]
    # A stop token is produced (and billed) but never shown; a length stop ends on a delta.
    assert entry.completion_tokens == last_delta["usage"]["completion_tokens"] + (finish == "stop")
    assert entry.status in ("completed", "length")
    assert entry.api_key.name == "test"
    assert entry.received_at <= entry.started_at <= entry.first_token_at <= entry.finished_at
    assert entry.tokenizer.startswith(MODEL)


def test_n_choices_stream_side_by_side_and_bill_the_prompt_once(live_service, api_key, tokenizer):
    body = chat_body("Name an animal.", temperature=1.0, seed=7, max_tokens=8, n=3)
    streamed = stream_chat(live_service, api_key, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [data for _, data in streamed[:-1]]
    by_choice = {i: [choice for c in chunks for choice in c["choices"] if choice["index"] == i] for i in range(3)}
    for parts in by_choice.values():
        assert parts[0]["delta"]["role"] == "assistant" and all("role" not in p["delta"] for p in parts[1:])
        assert parts[-1]["finish_reason"] in ("stop", "length") and all(p["finish_reason"] is None for p in parts[:-1])
    texts = ["".join(p["delta"].get("content", "") for p in by_choice[i]) for i in range(3)]
    whole = httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120).json()
    assert [c["message"]["content"] for c in whole["choices"]] == texts  # the seeds repeat per choice
    assert len(set(texts)) > 1
    entry = UsageEntry.objects.get(request_id=chunks[0]["id"])
    assert entry.prompt_tokens == len(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True))
    assert chunks[-1]["usage"]["completion_tokens"] == entry.completion_tokens == whole["usage"]["completion_tokens"]
    assert entry.completion_tokens <= 3 * 8


def test_beam_search_streams_what_the_workers_engine_finds(live_service, api_key, model):
    """The beam an engine built as the worker builds it finds here (the weight format `auto`
    chose, the compiled step the worker saved). That the engine's beam search is transformers'
    own is tests/test_engine.py's, in float32: the reduced formats round activations to int8,
    so their beam can part from float32's at a near tie (it did here, in int4)."""
    body = chat_body("Write a haiku about tea.", max_tokens=24, tokstream={"beam_width": 4})
    streamed = stream_chat(live_service, api_key, {**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [data for _, data in streamed[:-1]]
    prompt = model.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    engine = engines.engine_for(model)  # not build_engine: it frees the matrices other tests read
    beam = Request("beam", prompt, SamplingParams(max_tokens=24, beam_width=4))
    engine.add(beam)
    while engine.has_work():
        engine.step()
    assert content_of(chunks) == model.tokenizer.decode(beam.output_ids, skip_special_tokens=True)
    assert chunks[-1]["usage"]["completion_tokens"] == len(beam.output_ids)
    whole = httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120).json()
    assert whole["choices"][0]["message"]["content"] == content_of(chunks)


def test_a_client_that_leaves_cancels_its_request(live_service, api_key):
    body = chat_body("Write a long essay about the history of tea.", max_tokens=400, stream=True, temperature=0.7, seed=1)
    with httpx.stream("POST", f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=60) as response:
        request_id = None
        for n, (_, data) in enumerate(events(response)):
            request_id = data["id"]
            if n == 2:
                break  # leave after the first deltas
    entry = wait_for_entry(seconds=10, request_id=request_id)
    assert entry.status == "cancelled"
    assert entry.finish_reason == "cancelled"
    assert 3 <= entry.completion_tokens < 100
    assert entry.prompt_tokens > 0


def test_a_client_that_leaves_a_whole_completion_cancels_it(live_service, api_key):
    body = chat_body("Write a long essay about the history of tea.", max_tokens=400, temperature=0.7, seed=1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=httpx.Timeout(10, read=1.5))
    entry = wait_for_entry(seconds=10, api_key__key_hash=hash_key(api_key))
    assert entry.status == "cancelled"
    assert 0 < entry.completion_tokens < 400


def test_a_stop_string_ends_the_stream_without_showing_it(live_service, api_key):
    body = chat_body("Count from 1 to 10, separated by commas.", temperature=0, max_tokens=40, stream=True)
    full = content_of(data for _, data in stream_chat(live_service, api_key, body)[:-1])
    assert "5" in full
    cut = stream_chat(live_service, api_key, {**body, "stop": ["5"]})
    assert content_of(data for _, data in cut[:-1]) == full[: full.index("5")]
    assert cut[-2][1]["choices"][0]["finish_reason"] == "stop"


def test_sampling_parameters_reach_the_model(live_service, api_key, tokenizer):
    [banana] = tokenizer.encode(" banana", add_special_tokens=False)
    body = chat_body(PROMPT, max_tokens=6, top_k=40, min_p=0.05, presence_penalty=0.5, repetition_penalty=1.1, logit_bias={str(banana): 100})
    whole = httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120).json()
    assert whole["choices"][0]["message"]["content"] == " banana" * 6


def test_logprobs_come_with_each_token_in_the_openai_shape(live_service, api_key):
    body = chat_body("Name a colour. Use an emoji 🎨.", temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    streamed = stream_chat(live_service, api_key, {**body, "stream": True, "stream_options": {"include_usage": True}})
    tokens = [t for _, c in streamed[:-1] if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    finish, usage = streamed[-3][1]["choices"][0]["finish_reason"], streamed[-2][1]["usage"]
    assert len(tokens) == usage["completion_tokens"] - (finish == "stop") > 3  # the end-of-turn token has none
    for token in tokens:
        assert token["logprob"] <= 0 and len(token["top_logprobs"]) == 3
        assert token["top_logprobs"][0]["logprob"] == token["logprob"]  # greedy took the most likely
        assert [t["logprob"] for t in token["top_logprobs"]] == sorted((t["logprob"] for t in token["top_logprobs"]), reverse=True)
    assert bytes(b for t in tokens for b in t["bytes"]).decode() == content_of(c for _, c in streamed[:-1])
    whole = httpx.post(f"{live_service.url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=120).json()
    again = whole["choices"][0]["logprobs"]["content"]
    assert [t["bytes"] for t in again] == [t["bytes"] for t in tokens]
    # The same numbers, up to float noise: the other request shared different steps and took
    # its prompt's start from the prefix cache. A reduced weight format (`auto` here) rounds
    # activations to bfloat16, which turns 1e-7 of noise into about 1e-2 (float32: 1e-6), and
    # once, late in a full run with a well-filled prefix cache, a little over 5e-2.
    assert all(abs(a["logprob"] - b["logprob"]) < 0.1 for a, b in zip(again, tokens))


def test_models_are_listed(live_service, api_key):
    response = httpx.get(f"{live_service.url}/v1/models", headers=auth(api_key))
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["echo", MODEL]  # as tests/settings.py registers them


def test_health_reports_database_redis_and_workers(live_service):
    response = httpx.get(f"{live_service.url}/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["checks"]["workers"]["models"] == {MODEL: 1, "echo": 1}
    assert all(check["ok"] for check in body["checks"].values())


def test_the_worker_loaded_its_model_once(live_service, api_key):
    for _ in range(2):
        stream_chat(live_service, api_key, chat_body("Hi", max_tokens=2, stream=True))
    assert (live_service.logs / "worker.log").read_text().count(f"model {MODEL} loaded") == 1
