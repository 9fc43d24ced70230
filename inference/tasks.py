"""The Celery side: run one request on this process's engine and relay it to the Redis log.

Whatever happens, the request ends with exactly one ledger entry and an end entry in its log,
so no client is left waiting.
"""

import logging
import queue
import time

from celery import shared_task

from billing import ledger
from billing.models import UsageEntry

from . import limits, metrics, streamlog
from .engine import SamplingParams, choices
from .tools import ToolCallParser
from .worker import engine_loop

log = logging.getLogger(__name__)
DRAIN_SECONDS = 30


@shared_task(name="inference.tasks.generate")
def generate(request_id, model, prompt_ids, params, received_at, api_key_id=None, user_id=None, n=1, tools=False):
    if UsageEntry.objects.filter(request_id=request_id).exists():
        return  # a second delivery of a request already recorded
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
        try:
            record(request_id, requests, model, tokenizer_id, received_at, api_key_id, user_id)
        except Exception:  # the client still gets its end; the operator gets the alarm
            log.critical("no ledger entry could be written for request %s", request_id, exc_info=True)
        streamlog.append(client, request_id, end_entry(requests))
        record_metrics(client, model, requests, received_at, gaps)


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
            for entry in log_entries(output, requests, parsers.get(output.index)):
                streamlog.append(client, requests[0].group, entry)
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
    entry = {"t": "steer", "text": output.steered, "prompt_tokens": prompt_tokens(requests)}
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


def completion_tokens(requests):
    return sum(len(r.output_ids) for r in requests)


def earliest(times):
    times = [t for t in times if t is not None]
    return ledger.as_datetime(min(times)) if times else None


def record(request_id, requests, model, tokenizer_id, received_at, api_key_id, user_id):
    errors = [r.error for r in requests if r.error]
    return ledger.record(
        request_id,
        finish_reason_of(requests),
        api_key_id=api_key_id,
        user_id=user_id,
        model=model,
        model_served=model,
        tokenizer=tokenizer_id,
        prompt_tokens=prompt_tokens(requests),
        cached_prompt_tokens=requests[0].cached_tokens,  # the prompt is billed once, as choice 0 read it
        steering_tokens=sum(r.steered_tokens for r in requests),
        completion_tokens=completion_tokens(requests),
        error=errors[0] if errors else "",
        received_at=ledger.as_datetime(received_at),
        started_at=earliest(r.started_at for r in requests),
        first_token_at=earliest(r.first_token_at for r in requests),
        finished_at=ledger.as_datetime(max((r.finished_at or time.time()) for r in requests)),
    )


def record_metrics(client, model, requests, received_at, gaps):
    def since_arrival(times, pick):
        times = [t for t in times if t is not None]
        return pick(times) - received_at if times else None

    timings = {
        "queue_time_seconds": since_arrival((r.started_at for r in requests), min),
        "time_to_first_token_seconds": since_arrival((r.first_token_at for r in requests), min),
        "e2e_request_latency_seconds": max((r.finished_at or time.time()) for r in requests) - received_at,
    }
    outcome = ledger.STATUS_OF_REASON[finish_reason_of(requests)]
    try:
        metrics.record_request(client, model, str(outcome), timings, gaps, prompt_tokens(requests), completion_tokens(requests))
    except Exception:  # metrics must never cost a request its end
        log.warning("metrics for request %s were not recorded", requests[0].group, exc_info=True)


def end_entry(requests):
    """The last log entry: the same counts the ledger entry was given, and each choice's ending."""
    prompt, completion = prompt_tokens(requests), completion_tokens(requests)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    end = {"t": "end", "finish_reasons": [r.finish_reason or "error" for r in requests], "usage": usage}
    errors = [r.error for r in requests if r.error]
    if errors:
        end["error"] = errors[0]
    return end
