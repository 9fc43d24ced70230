"""Models served by an OpenAI-compatible upstream: counting their tokens as the vendor bills
them, and the worker's relay of the upstream stream into the request's log.

A registry entry: {"source": "openai-compatible", "base_url": ".../v1", "api_key_env": NAME,
"upstream_model": NAME, "tokenizer": T, "context_length": N}, where T is a tiktoken encoding
(`o200k_base`, `cl100k_base`) or the name of a registered local model whose tokenizer and chat
template the upstream uses.
"""

import json
import os
import threading
import time

import httpx
from django.conf import settings

from billing import counting, ledger, tiktoken_offline

from . import registry, streamlog, tools
from .errors import ApiError, invalid

DEFAULT_CONTEXT = 131072
READ_TIMEOUT = 120.0  # seconds without a byte from the upstream; an entry's "timeout_seconds" overrides it
CANCEL_CHECK_SECONDS = 0.25
# What a relayed request may carry; everything else our parser accepts is refused, by name.
NOT_RELAYED = {"n": 1, "beam_width": 1, "logprobs": False, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def entry(model):
    return settings.TOKSTREAM_MODELS[model]


def tokenizer_id(model):
    return entry(model)["tokenizer"] if registry.uses_tiktoken(model) else f"{model}:{entry(model)['tokenizer']}"


def context_length(model):
    return int(entry(model).get("context_length", DEFAULT_CONTEXT))


# -- counting -------------------------------------------------------------------------------


def count_prompt(chat):
    """Prompt tokens as the upstream bills them: OpenAI's message framing and tool overhead
    for a tiktoken family, else the local model's chat template, as that model reads it."""
    name = entry(chat.model)["tokenizer"]
    if registry.uses_tiktoken(chat.model):
        try:
            return counting.chat_prompt_tokens([plain(m) for m in chat.original_messages], name, chat.tools)
        except tiktoken_offline.EncodingUnavailable as exc:
            raise ApiError(503, f"The tokenizer of `{chat.model}` is not available: {exc}", type="server_error") from None
    turns = tools.render(chat.messages, chat.tools)
    return len(registry.tokenizer(name).apply_chat_template(turns, add_generation_prompt=True, tokenize=True))


def plain(message):
    """A message as text fields only (what the counting rules count)."""
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in message.items() if value is not None}


def count_completion(model, text, finish_reason):
    """Tokens of the relayed text; a local chat model also produced its end-of-turn token."""
    name = entry(model)["tokenizer"]
    if registry.uses_tiktoken(model):
        return counting.text_tokens(text, name)
    ids = registry.tokenizer(name).encode(text, add_special_tokens=False)
    return len(ids) + (finish_reason == "stop")


def check(chat):
    for name, default in NOT_RELAYED.items():
        value = chat.n if name == "n" else chat.sampling.get(name, default)
        if value != default:
            raise invalid(f"`{name}` is not supported for the upstream model `{chat.model}`.", param=name)


def request_body(chat, max_tokens):
    """What the worker sends upstream: our request, in the upstream's name, always streamed
    with the usage at the end."""
    sampling = {k: v for k, v in chat.sampling.items() if k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "logit_bias")}
    body = {**{k: v for k, v in sampling.items() if v not in (None, [], {})}, "messages": chat.original_messages, "max_tokens": max_tokens}
    if chat.tools:
        body["tools"] = chat.tools
    return {**body, "model": entry(chat.model)["upstream_model"], "stream": True, "stream_options": {"include_usage": True}}


# -- the relay (in the worker) ------------------------------------------------------------------


class Relay:
    """One upstream request: its text, its calls, the vendor's usage and how it ended."""

    def __init__(self, model, request_id):
        self.model, self.request_id = model, request_id
        self.text, self.call_text = [], []
        self.sent = False  # the upstream took the request: from then on its prompt is billed
        self.counted = 0  # completion tokens so far, delta by delta (the end count is exact)
        self.vendor_usage = None
        self.vendor_id = ""  # the upstream's id of the request: its invoice lines name it
        self.finish_reason, self.error = None, ""
        self.first_token_at = None
        self.calls = set()

    def run(self, client, body):
        url = entry(self.model)["base_url"].rstrip("/") + "/chat/completions"
        key = os.environ.get(entry(self.model).get("api_key_env") or "", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if client.exists(streamlog.key(self.request_id, "cancel")):
            self.finish_reason = "cancelled"  # cancelled while it queued: never sent
            return
        try:
            timeout = httpx.Timeout(10.0, read=float(entry(self.model).get("timeout_seconds", READ_TIMEOUT)))
            with httpx.Client(timeout=timeout) as http, http.stream("POST", url, json=body, headers=headers) as response:
                if response.status_code != 200:
                    return self.fail(f"the upstream answered {response.status_code}: {upstream_message(response)}")
                self.sent = True
                self.follow(client, response)
        except httpx.TimeoutException:
            self.fail("the upstream did not answer in time")
        except (httpx.HTTPError, httpx.StreamError) as exc:
            self.fail(f"the upstream connection failed: {exc}")
        if self.finish_reason is None:
            self.fail("the upstream stream ended without a finish reason")

    def follow(self, client, response):
        with CancelWatch(client, self.request_id, response) as watch:
            try:
                self.read(client, response)
            except Exception:
                if not watch.cancelled:
                    raise
        if watch.cancelled:
            self.finish_reason = "cancelled"

    def fail(self, message):
        self.finish_reason, self.error = "error", message

    def read(self, client, response):
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            entries = self.entries(json.loads(data))
            if entries:
                streamlog.append(client, self.request_id, *entries)

    def entries(self, chunk):
        self.vendor_id = self.vendor_id or str(chunk.get("id") or "")[:100]
        if chunk.get("usage"):
            self.vendor_usage = chunk["usage"]
        if chunk.get("error"):
            self.fail(f"the upstream failed: {chunk['error'].get('message', chunk['error'])}")
        found = []
        for choice in chunk.get("choices") or []:
            found += self.choice_entries(choice)
        return found

    def choice_entries(self, choice):
        delta, found = choice.get("delta") or {}, []
        if delta.get("content"):
            self.text.append(delta["content"])
            found.append({"t": "delta", "text": delta["content"], "n": self.count(delta["content"])})
        for call in delta.get("tool_calls") or []:
            found += self.call_entries(call)
        if found and self.first_token_at is None:
            self.first_token_at = time.time()
        if choice.get("finish_reason"):
            reason = choice["finish_reason"]
            self.finish_reason = reason if reason in ledger.STATUS_OF_REASON else "stop"
        return found

    def call_entries(self, call):
        """A call's first chunk names it (and may carry all its arguments); later ones add arguments."""
        function, index, found = call.get("function") or {}, call.get("index", 0), []
        if index not in self.calls:
            self.calls.add(index)
            self.call_text.append(function.get("name", ""))
            found.append({"t": "tool", "index": index, "id": call.get("id", f"call_{index}"), "name": function.get("name", "")})
        if function.get("arguments"):
            self.call_text.append(function["arguments"])
            found.append({"t": "args", "index": index, "text": function["arguments"]})
        return found

    def count(self, text):
        """The usage so far for continuous usage stats: delta by delta (a token split across
        two deltas counts twice until the end's exact count)."""
        self.counted += count_completion(self.model, text, None)
        return self.counted

    def completion_tokens(self):
        return count_completion(self.model, "".join(self.text + self.call_text), self.finish_reason)


def upstream_message(response):
    try:
        response.read()
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError, httpx.HTTPError):
        return response.text[:300] if response.is_stream_consumed else "(no body)"


class CancelWatch:
    """While the relay reads, check the request's cancel flag a few times a second and close
    the upstream response when it is set: the upstream sees its client leave."""

    def __init__(self, client, request_id, response):
        self.client, self.request_id, self.response = client, request_id, response
        self.done = threading.Event()
        self.cancelled = False

    def __enter__(self):
        threading.Thread(target=self.watch, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()

    def watch(self):
        while not self.done.wait(CANCEL_CHECK_SECONDS):
            if self.client.exists(streamlog.key(self.request_id, "cancel")):
                self.cancelled = True
                self.response.close()
                return
