"""The worker's relay of an upstream model's stream into the request's log (how an upstream
is counted and what it is sent: inference/backends.py)."""

import json
import os
import threading
import time

import httpx

from billing import ledger
from inference import backends, streamlog
from inference.protocol.entries import Delta, FinishReason, ToolArgs, ToolStart

READ_TIMEOUT = 120.0  # seconds without a byte from the upstream; an entry's "timeout_seconds" overrides it
CANCEL_CHECK_SECONDS = 0.25


class Relay:
    """One upstream request: its text, its calls, the vendor's usage and how it ended."""

    def __init__(self, model, request_id):
        self.model, self.request_id = model, request_id
        self.backend = backends.of(model)
        self.text, self.call_text = [], []
        self.sent = False  # the upstream took the request: from then on its prompt is billed
        self.counted = 0  # completion tokens so far, delta by delta (the end count is exact)
        self.vendor_usage = None
        self.vendor_id = ""  # the upstream's id of the request: its invoice lines name it
        self.finish_reason, self.error = None, ""
        self.first_token_at = None
        self.calls = set()

    def run(self, client, body):
        url = self.backend.entry["base_url"].rstrip("/") + "/chat/completions"
        key = os.environ.get(self.backend.entry.get("api_key_env") or "", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if client.exists(streamlog.key(self.request_id, "cancel")):
            self.finish_reason = FinishReason.CANCELLED  # cancelled while it queued: never sent
            return
        try:
            timeout = httpx.Timeout(10.0, read=float(self.backend.entry.get("timeout_seconds", READ_TIMEOUT)))
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
            self.finish_reason = FinishReason.CANCELLED

    def fail(self, message):
        self.finish_reason, self.error = FinishReason.ERROR, message

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
            found.append(Delta(delta["content"], self.count(delta["content"])))
        for call in delta.get("tool_calls") or []:
            found += self.call_entries(call)
        if found and self.first_token_at is None:
            self.first_token_at = time.time()
        if choice.get("finish_reason"):
            reason = choice["finish_reason"]
            self.finish_reason = reason if reason in ledger.STATUS_OF_REASON else FinishReason.STOP
        return found

    def call_entries(self, call):
        """A call's first chunk names it (and may carry all its arguments); later ones add arguments."""
        function, index, found = call.get("function") or {}, call.get("index", 0), []
        if index not in self.calls:
            self.calls.add(index)
            self.call_text.append(function.get("name", ""))
            found.append(ToolStart(index, call.get("id", f"call_{index}"), function.get("name", "")))
        if function.get("arguments"):
            self.call_text.append(function["arguments"])
            found.append(ToolArgs(index, function["arguments"]))
        return found

    def count(self, text):
        """The usage so far for continuous usage stats: delta by delta (a token split across
        two deltas counts twice until the end's exact count)."""
        self.counted += self.backend.count_completion(text, None)
        return self.counted

    def completion_tokens(self):
        return self.backend.count_completion("".join(self.text + self.call_text), self.finish_reason)


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
