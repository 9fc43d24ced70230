"""The worker's relay of an upstream model's stream into the request's log (what an upstream
is sent and how it is counted: inference/upstream.py)."""

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time

import httpx

from billing import ledger
from inference import backends, lifecycle, streamlog, upstream
from inference.protocol.entries import Accepted, Delta, FinishReason, Refusal, ToolArgs, ToolStart
from inference.worker import slots

log = logging.getLogger(__name__)
CONNECT_TIMEOUT = 10.0  # seconds to connect to an upstream (and to write the request, and to get a pooled connection)
READ_TIMEOUT = 120.0  # seconds without a byte from the upstream; an entry's "timeout_seconds" overrides it
CANCEL_CHECK_SECONDS = 0.25
CREDENTIALS_REFUSED = (401, 403, 407)  # our key for the upstream, not the client's: a 502


class Relay:
    """One upstream request: its text, its calls, the vendor's usage and how it ended."""

    def __init__(self, model, request_id):
        self.model, self.request_id = model, request_id
        self.backend = backends.of(model)
        self.text, self.call_text = [], []
        self.sent = False  # the upstream took the request: from then on its prompt is billed
        self.counted = 0  # completion tokens so far, delta by delta (the end count is exact)
        self.vendor_usage = None  # upstream.VendorUsage, from the last chunk that carried usage
        self.vendor_id = ""  # the upstream's id of the request: its invoice lines name it
        self.finish_reason, self.error, self.code, self.refusal = None, "", None, None
        self.started_at = self.first_token_at = None
        self.calls = set()
        self.stop = []
        self.stop_reason = upstream.UNSAID  # vLLM's: the stop string that ended the reply, if one did
        self.limit = None  # our completion budget, where the upstream was given none

    def run(self, client, body, worker_id, max_tokens):
        """Wait for a slot at the upstream, then relay its answer; never sent when the client
        left or the deadline passed while it waited. A client that set no `max_tokens` gets
        ours (TOKSTREAM_DEFAULT_MAX_TOKENS, which its budget hold assumed): the upstream is not
        told it (it gets only what the client sent), the relay stops reading there."""
        self.stop = [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or []
        self.limit = None if {"max_tokens", "max_completion_tokens"} & set(body) else max_tokens
        slot = slots.Slot(client, self.backend.slots, self.request_id, self.backend.max_concurrent, time.time())
        if not slot.wait(lambda: self.unwanted(client, worker_id)):
            return
        try:
            self.started_at = time.time()
            streamlog.leave_queue(client, self.model, self.request_id)
            with CancelWatch(client, self.request_id, slot) as watch:
                self.send(client, body, watch)
        finally:
            release(slot)

    def unwanted(self, client, worker_id):
        """Over before it was sent, as `lifecycle.verdict` says: its client left, the deadline
        admission stored passed, or someone else ended it."""
        found = lifecycle.verdict(lifecycle.read(client, self.request_id), self.model, time.time(), by=worker_id)
        if found in lifecycle.MESSAGES:
            self.fail(lifecycle.MESSAGES[found], code=lifecycle.CODES[found])
        elif found is not None:
            self.finish_reason = FinishReason.CANCELLED  # never sent: billed nothing
        return found is not None

    def send(self, client, body, watch):
        url = self.backend.entry["base_url"].rstrip("/") + "/chat/completions"
        key = os.environ.get(self.backend.entry.get("api_key_env") or "", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            timeout = httpx.Timeout(CONNECT_TIMEOUT, read=float(self.backend.entry.get("timeout_seconds", READ_TIMEOUT)))
            with httpx.Client(timeout=timeout) as http, http.stream("POST", url, json=body, headers=headers, extensions={"trace": watch.trace}) as response:
                if response.status_code != 200:
                    return self.refused(response)
                self.sent = True
                watch.response = response
                streamlog.append(client, self.request_id, Accepted())
                self.read(client, response)
        except httpx.TimeoutException:
            self.broken(watch, "the upstream did not answer in time", 504)
        except (httpx.HTTPError, httpx.StreamError) as exc:
            self.broken(watch, f"the upstream connection failed: {exc}", 502)
        except ValueError as exc:  # an event that is not JSON: one cut in the middle, say
            self.broken(watch, f"the upstream sent an event that is not JSON: {exc}", 502)
        if self.finish_reason is None:
            self.broken(watch, "the upstream stream ended without a finish reason")

    def broken(self, watch, message, status=None):
        """The answer ended early: cut by us because the client left, or a failure (before the
        first byte, a gateway's status). A reply whose finish reason had come was whole: only
        its usage was lost (it is billed as our estimate)."""
        if self.finish_reason is not None:
            return
        if watch.cancelled:
            # The upstream read a request cut while it was silent (a prefill): its prompt is billed.
            self.sent = self.sent or watch.delivered
            self.finish_reason = FinishReason.CANCELLED
            return
        self.fail(message, refusal=gateway_refusal(status) if status and not self.sent else None)

    def refused(self, response):
        """The upstream refused before its first byte: its client is told the same status and
        error, except that a refusal of our own credentials (or an answer that is no error) is
        the gateway's failure (502)."""
        status, error = response.status_code, upstream_error(response)
        message = f"the upstream answered {status}: {error.get('message') or '(no message)'}"
        if status in CREDENTIALS_REFUSED or not 400 <= status < 600:
            status, error = 502, {}
        kind = error.get("type") if isinstance(error.get("type"), str) else ("server_error" if status >= 500 else "invalid_request_error")
        param, code = error.get("param"), error.get("code")
        refusal = Refusal(status, kind, param if isinstance(param, str) else None, response.headers.get("retry-after"))
        self.fail(message, code=str(code) if code is not None else None, refusal=refusal)

    def fail(self, message, code=None, refusal=None):
        self.finish_reason, self.error, self.code, self.refusal = FinishReason.ERROR, message, code, refusal

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
            if self.limit is not None and self.counted >= self.limit and self.finish_reason is None:
                self.finish_reason = FinishReason.LENGTH  # leaving closes the upstream request
                return

    def entries(self, chunk):
        if not isinstance(chunk, dict):
            return []  # not a chunk: nothing of the reply is in it
        self.vendor_id = self.vendor_id or str(chunk.get("id") or "")[:100]
        if chunk.get("usage"):
            self.vendor_usage = upstream.vendor_usage(chunk["usage"])
        if error := chunk.get("error"):
            self.fail(f"the upstream failed: {error.get('message', error) if isinstance(error, dict) else error}")
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
        if choice.get("finish_reason") and self.finish_reason != FinishReason.ERROR:  # an error chunk came first
            reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason", upstream.UNSAID)
            self.finish_reason = reason if reason in ledger.STATUS_OF_REASON else FinishReason.STOP
        return found

    def call_entries(self, call):
        """A call's first chunk names it (and may carry all its arguments); later ones add arguments."""
        function, index, found = call.get("function") or {}, call.get("index", 0), []
        if index not in self.calls:
            self.calls.add(index)
            self.call_text.append(function.get("name", ""))
            found.append(ToolStart(index, call.get("id", f"call_{index}"), function.get("name", ""), completion_tokens=self.count(function.get("name", ""))))
        if function.get("arguments"):
            self.call_text.append(function["arguments"])
            found.append(ToolArgs(index, function["arguments"], completion_tokens=self.count(function["arguments"])))
        return found

    def count(self, text):
        """The usage so far for continuous usage stats: delta by delta (a token split across
        two deltas counts twice until the end's count)."""
        self.counted += self.backend.count_text(text)
        return self.counted

    def completion_tokens(self):
        """Our count of the whole reply (inference/upstream.py says how)."""
        return self.backend.count_completion("".join(self.text + self.call_text), self.finish_reason, self.stop, self.stop_reason)


def gateway_refusal(status):
    """No answer from the upstream before its first byte: a gateway's status, 502 or 504."""
    return Refusal(status, "server_error")


def upstream_error(response):
    """The error object of an upstream's refusal ({"error": {...}}, or a bare one, or text)."""
    try:
        response.read()
        data = response.json()
    except (ValueError, httpx.HTTPError):
        return {"message": response.text[:300] if response.is_stream_consumed else ""}
    error = data.get("error", data) if isinstance(data, dict) else {}
    if isinstance(error, str):
        return {"message": error}
    return error if isinstance(error, dict) else {}


def release(slot):
    try:
        slot.release()
    except Exception:  # Redis away: the lease runs out by itself, and the request's outcome stands
        log.warning("could not release the upstream slot of %s", slot.request_id, exc_info=True)


class CancelWatch:
    """From before the request is sent until its answer ends: check the request's cancel flag a
    few times a second and, when it is set, cut the upstream's connection, so the upstream sees
    its client leave even while it is silent (a long prefill sends no byte). It also keeps the
    request's slot at the upstream for as long."""

    def __init__(self, client, request_id, slot):
        self.client, self.request_id, self.slot = client, request_id, slot
        self.done = threading.Event()
        self.cancelled = False
        self.delivered = False  # the whole request went out: the upstream has read its prompt
        self.sockets = []
        self.response = None  # once the upstream answered

    def __enter__(self):
        threading.Thread(target=self.watch, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()

    def trace(self, event, info):
        """httpx's trace hook: the connection's socket, to cut (a TLS connection's is the TLS
        socket, which takes the TCP one over). A closed response or client would not wake a
        read blocked on a silent upstream; a shut-down socket does."""
        if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
            self.sockets.append(info["return_value"].get_extra_info("socket"))
            if self.cancelled:
                self.cut()
        elif event.endswith("send_request_body.complete"):
            self.delivered = True

    def watch(self):
        while not self.done.wait(CANCEL_CHECK_SECONDS):
            try:
                self.slot.renew()
                if self.client.exists(streamlog.key(self.request_id, "cancel")):
                    self.cancelled = True
                    return self.cut()
            except Exception:  # Redis away for a moment: the lease outlasts it, and the next check comes
                log.warning("could not check on the upstream request %s", self.request_id, exc_info=True)

    def cut(self):
        for sock in self.sockets:
            with contextlib.suppress(OSError):  # already closed, or taken over by TLS
                sock.shutdown(socket.SHUT_RDWR)
        if self.response is not None:  # a response still streaming ends at its next read too
            with contextlib.suppress(Exception):
                self.response.close()


# -- running and billing one relayed request --------------------------------------------------


def run_relayed(client, admitted, body, worker_id, max_tokens):
    """A request for an upstream model: its stream relayed into the log, billed as the
    upstream's usage says (our count beside it), or by our count as an estimate."""
    relay = Relay(admitted.model, admitted.request_id)
    try:
        relay.run(client, body, worker_id, max_tokens)
    except Exception as exc:
        log.exception("request %s failed", admitted.request_id)
        relay.fail(f"the relay failed: {exc}")
    finally:
        counted_prompt = admitted.prompt_tokens if relay.sent else 0  # a request the upstream never took costs nothing
        prompt_tokens, completion_tokens, provenance = upstream_billing(relay, counted_prompt, counted_completion(relay))
        outcome = lifecycle.Outcome(
            relay.finish_reason, prompt_tokens, completion_tokens, relay.error, relay.started_at, relay.first_token_at, time.time(), relay.code, relay.refusal
        )
        lifecycle.end(client, admitted, outcome, [relay.finish_reason], provenance=provenance)


def counted_completion(relay):
    """Our count of the reply; should counting itself fail, the sum of its deltas' counts, so
    the request still ends, billed, and its client is told."""
    try:
        return relay.completion_tokens()
    except Exception:
        log.exception("could not count the reply of %s", relay.request_id)
        return relay.counted


def upstream_billing(relay, counted_prompt, counted_completion):
    """(prompt tokens billed, completion tokens billed, the entry's Provenance): the
    upstream's usage when it reported it, our count beside it; otherwise our count, marked as
    an estimate, with nothing to compare it to."""
    ours = ledger.Provenance(
        usage_source=upstream.ESTIMATED,
        model_served=relay.backend.served_model,
        tokenizer=relay.backend.tokenizer_id(),
        vendor_request_id=relay.vendor_id,
        counted_prompt_tokens=counted_prompt,
        counted_completion_tokens=counted_completion,
    )
    reported = relay.vendor_usage
    if reported is None:
        return counted_prompt, counted_completion, ours
    theirs = dataclasses.replace(
        ours, usage_source=upstream.FROM_UPSTREAM, cached_prompt_tokens=min(reported.cached_prompt_tokens, reported.prompt_tokens),
        vendor_prompt_tokens=reported.prompt_tokens, vendor_cached_prompt_tokens=reported.cached_prompt_tokens,
        vendor_completion_tokens=reported.completion_tokens,
    )  # fmt: skip
    return reported.prompt_tokens, reported.completion_tokens, theirs
