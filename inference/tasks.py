"""The Celery side: run one request on this process's engine and relay it to the Redis log.

Whatever happens, the request ends with exactly one ledger entry and an end entry in its log,
so no client is left waiting.
"""

import logging
import queue
import time
from dataclasses import dataclass

from celery import shared_task

from billing import ledger
from billing.models import UsageEntry

from . import chats, limits, metrics, streamlog, upstream
from .admission import release_hold
from .engine import SamplingParams, choices
from .tools import ToolCallParser
from .worker import engine_loop

log = logging.getLogger(__name__)
DRAIN_SECONDS = 30


@shared_task(name="inference.tasks.generate")
def generate(request_id, model, prompt_ids, params, received_at, api_key_id=None, user_id=None, n=1, tools=False, reservation=None, upstream_body=None, prompt_tokens=0):
    if UsageEntry.objects.filter(request_id=request_id).exists():
        return  # a second delivery of a request already recorded
    if upstream_body is not None:
        return relay_upstream(request_id, model, upstream_body, prompt_tokens, received_at, api_key_id, user_id, reservation)
    requests = choices(request_id, prompt_ids, SamplingParams(**params), n)
    client = streamlog.sync_client()
    tokenizer_id, gaps = "", []
    try:
        loop = engine_loop(model)
        limits.claim(client, request_id, model, loop.worker_id)
        tokenizer_id = loop.model.tokenizer_id
        relay(loop, requests, client, tools, gaps)
    except Exception as exc:
        log.exception("request %s failed", request_id)
        for request in requests:
            if request.finish_reason is None:
                request.finish_reason, request.error = "error", f"generation failed: {exc}"
    finally:
        outcome = Outcome.of(requests)
        finish_reasons = [r.finish_reason or "error" for r in requests]
        write_entry = lambda: record(request_id, requests, outcome, model, tokenizer_id, received_at, api_key_id, user_id)  # noqa: E731
        finish(client, request_id, model, outcome, finish_reasons, write_entry, received_at, reservation, gaps)


def relay_upstream(request_id, model, body, prompt_tokens, received_at, api_key_id, user_id, reservation):
    """A request for an upstream model: its stream relayed into the log, counted by us."""
    client = streamlog.sync_client()
    relay, started_at = upstream.Relay(model, request_id), time.time()
    try:
        limits.claim(client, request_id, model, engine_loop(model).worker_id)
        relay.run(client, body)
    except Exception as exc:
        log.exception("request %s failed", request_id)
        relay.fail(f"the relay failed: {exc}")
    finally:
        billed = prompt_tokens if relay.sent else 0  # a request the upstream never took costs nothing
        outcome = Outcome(relay.finish_reason, billed, relay.completion_tokens(), relay.error, started_at, relay.first_token_at, time.time())
        write_entry = lambda: record_upstream(request_id, model, relay, outcome, received_at, api_key_id, user_id)  # noqa: E731
        finish(client, request_id, model, outcome, [relay.finish_reason], write_entry, received_at, reservation, [])


def finish(client, request_id, model, outcome, finish_reasons, write_entry, received_at, reservation, gaps):
    """Whatever happened: one ledger entry, the budget hold back, the end of the log."""
    try:
        write_entry()
    except Exception:  # the client still gets its end; the operator gets the alarm
        log.critical("no ledger entry could be written for request %s", request_id, exc_info=True)
    release(client, request_id, reservation)
    streamlog.append(client, request_id, end_entry(finish_reasons, outcome))
    limits.leave_queue(client, model, request_id)  # when no worker could claim it
    record_metrics(client, model, outcome, received_at, gaps)
    keep_chat_reply(request_id)


def keep_chat_reply(request_id):
    try:
        chats.settle_request(request_id)
    except Exception:  # the page settles it too when it next reads the chat
        log.warning("the chat reply of request %s was not saved", request_id, exc_info=True)


def release(client, request_id, reservation):
    try:
        release_hold(client, request_id, reservation)
    except Exception:  # the hold stays until an operator frees it; the request still ends
        log.critical("the budget hold of request %s was not given back", request_id, exc_info=True)


def relay(loop, requests, client, tools=False, gaps=None):
    """Copy the engine's outputs to the log until every choice has finished; with tools, a
    parser per choice turns <tool_call> text into tool-call entries. The time between a
    choice's outputs goes to `gaps`."""
    outbox = loop.submit(*requests)
    parsers = {r.index: ToolCallParser() for r in requests} if tools else {}
    last_output = {}
    running = len(requests)
    try:
        while running:
            output = outbox.get()
            if output.text and gaps is not None:
                now = time.monotonic()
                if output.index in last_output:
                    gaps.append(now - last_output[output.index])
                last_output[output.index] = now
            entries = log_entries(output, requests, parsers.get(output.index))
            if entries:
                streamlog.append(client, requests[0].group, *entries)
            if output.finished:
                running -= 1
                ended_with_calls(requests[output.index], parsers.get(output.index))
    except Exception:
        # The log cannot take more: stop the engine too, and bill what it did up to then.
        loop.engine.cancel(requests[0].group)
        wait_until_finished(outbox, running)
        raise


def log_entries(output, requests, parser=None):
    entries = [steer_entry(output, requests)] if output.steered else []
    if parser is None:
        events = [("content", output.text)] if output.text else []
    else:
        events = parser.feed(output.text) + (parser.finish() if output.finished else [])
    entries += [event_entry(output, event) for event in events]
    if output.logprobs:  # they go with the step's first text, or alone
        deltas = [e for e in entries if e["t"] == "delta"] or [append_to(entries, delta_entry(output, ""))]
        deltas[0]["logprobs"] = output.logprobs
    return entries


def append_to(entries, entry):
    entries.append(entry)
    return entry


def event_entry(output, event):
    if event[0] == "content":
        return delta_entry(output, event[1])
    if event[0] == "call":
        entry = {"t": "tool", "index": event[1], "id": event[2], "name": event[3]}
    else:
        entry = {"t": "args", "index": event[1], "text": event[2]}
    return {**entry, "i": output.index} if output.index else entry


def ended_with_calls(request, parser):
    """A reply that made tool calls and stopped ends as OpenAI says: "tool_calls"."""
    if parser is not None and parser.calls and request.finish_reason == "stop":
        request.finish_reason = "tool_calls"


def steer_entry(output, requests):
    """Where steering took effect (or why it did not), and the prompt tokens since."""
    # The prompt and all steering so far (the engine counts it as it injects).
    entry = {"t": "steer", "text": output.steered, "prompt_tokens": len(requests[0].prompt_ids) + sum(r.steered_tokens for r in requests)}
    if output.index:
        entry["i"] = output.index
    if output.error:
        entry["error"] = output.error
    return entry


def delta_entry(output, text):
    entry = {"t": "delta", "text": text, "n": output.completion_tokens}
    if output.index:
        entry["i"] = output.index
    return entry


def wait_until_finished(outbox, running):
    deadline = time.monotonic() + DRAIN_SECONDS
    while running and time.monotonic() < deadline:
        try:
            running -= outbox.get(timeout=1).finished
        except queue.Empty:
            pass


# The ledger has one status per request: with n > 1, the worst of its choices' endings.
WORST_FIRST = ("error", "cancelled", "length", "tool_calls", "stop")


def finish_reason_of(requests):
    reasons = {r.finish_reason or "error" for r in requests}
    return next(reason for reason in WORST_FIRST if reason in reasons)


def prompt_tokens(requests):
    """The prompt once (as far as any choice consumed it; the others shared its cache), and
    every choice's steering."""
    steered = [r.steered_tokens for r in requests]
    return max(r.prefilled - s for r, s in zip(requests, steered)) + sum(steered)


@dataclass
class Outcome:
    """What the ledger, the end of the log and the metrics all say of one finished request."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str
    started_at: float | None
    first_token_at: float | None
    finished_at: float

    @classmethod
    def of(cls, requests):
        errors = [r.error for r in requests if r.error]
        return cls(
            finish_reason=finish_reason_of(requests),
            prompt_tokens=prompt_tokens(requests),
            completion_tokens=sum(len(r.output_ids) for r in requests),
            error=errors[0] if errors else "",
            started_at=earliest(r.started_at for r in requests),
            first_token_at=earliest(r.first_token_at for r in requests),
            finished_at=max((r.finished_at or time.time()) for r in requests),
        )

    def ledger_fields(self, received_at):
        """What every ledger entry takes from the outcome."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "error": self.error,
            "received_at": ledger.as_datetime(received_at),
            "started_at": ledger.as_datetime(self.started_at),
            "first_token_at": ledger.as_datetime(self.first_token_at),
            "finished_at": ledger.as_datetime(self.finished_at),
        }

    def usage(self):
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


def earliest(times):
    times = [t for t in times if t is not None]
    return min(times) if times else None


def record_entry(request_id, model, outcome, received_at, api_key_id, user_id, **fields):
    """The ledger entry of a finished request: what every entry takes from the outcome, and `fields`."""
    owner = {"api_key_id": api_key_id, "user_id": user_id}
    return ledger.record(request_id, outcome.finish_reason, model=model, **owner, **outcome.ledger_fields(received_at), **fields)


def record(request_id, requests, outcome, model, tokenizer_id, received_at, api_key_id, user_id):
    return record_entry(
        request_id, model, outcome, received_at, api_key_id, user_id,
        model_served=model,
        tokenizer=tokenizer_id,
        cached_prompt_tokens=requests[0].cached_tokens,  # the prompt is billed once, as choice 0 read it
        steering_tokens=sum(r.steered_tokens for r in requests),
    )  # fmt: skip


def record_upstream(request_id, model, relay, outcome, received_at, api_key_id, user_id):
    """Our counts are the entry's; the vendor's, when it reported them, stand beside them."""
    vendor = relay.vendor_usage or {}
    cached = (vendor.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return record_entry(
        request_id, model, outcome, received_at, api_key_id, user_id,
        model_served=upstream.entry(model)["upstream_model"],
        tokenizer=upstream.tokenizer_id(model),
        cached_prompt_tokens=min(cached, outcome.prompt_tokens),
        usage_source="upstream_counted",
        vendor_request_id=relay.vendor_id,
        vendor_prompt_tokens=vendor.get("prompt_tokens"),
        vendor_cached_prompt_tokens=cached if vendor else None,
        vendor_completion_tokens=vendor.get("completion_tokens"),
    )  # fmt: skip


def record_metrics(client, model, outcome, received_at, gaps):
    def since_arrival(moment):
        return None if moment is None else moment - received_at

    timings = {
        "queue_time_seconds": since_arrival(outcome.started_at),
        "time_to_first_token_seconds": since_arrival(outcome.first_token_at),
        "e2e_request_latency_seconds": since_arrival(outcome.finished_at),
    }
    status = str(ledger.STATUS_OF_REASON[outcome.finish_reason])
    try:
        metrics.record_request(client, model, status, timings, gaps, outcome.prompt_tokens, outcome.completion_tokens)
    except Exception:  # metrics must never cost a request its end
        log.warning("metrics for request %s were not recorded", model, exc_info=True)


def end_entry(finish_reasons, outcome):
    """The last log entry: the same counts the ledger entry was given, and each choice's ending."""
    end = {"t": "end", "finish_reasons": finish_reasons, "usage": outcome.usage()}
    if outcome.error:
        end["error"] = outcome.error
    return end
