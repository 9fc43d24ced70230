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

from . import limits, streamlog
from .engine import SamplingParams, choices
from .worker import engine_loop

log = logging.getLogger(__name__)
DRAIN_SECONDS = 30


@shared_task(name="inference.tasks.generate")
def generate(request_id, model, prompt_ids, params, received_at, api_key_id=None, user_id=None, n=1):
    if UsageEntry.objects.filter(request_id=request_id).exists():
        return  # a second delivery of a request already recorded
    requests = choices(request_id, prompt_ids, SamplingParams(**params), n)
    client = streamlog.sync_client()
    tokenizer_id = ""
    try:
        loop = engine_loop(model)
        limits.claim(client, request_id, model, loop.worker_id)
        tokenizer_id = loop.model.tokenizer_id
        relay(loop, requests, client)
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


def relay(loop, requests, client):
    """Copy the engine's outputs to the log until every choice has finished."""
    outbox = loop.submit(*requests)
    running = len(requests)
    try:
        while running:
            output = outbox.get()
            for entry in log_entries(output, requests):
                streamlog.append(client, requests[0].group, entry)
            running -= output.finished
    except Exception:
        # The log cannot take more: stop the engine too, and bill what it did up to then.
        loop.engine.cancel(requests[0].group)
        wait_until_finished(outbox, running)
        raise


def log_entries(output, requests):
    entries = [steer_entry(output, requests)] if output.steered else []
    if output.text or output.logprobs:
        entries.append(delta_entry(output))
    return entries


def steer_entry(output, requests):
    """Where steering took effect (or why it did not), and the prompt tokens since."""
    entry = {"t": "steer", "text": output.steered, "prompt_tokens": prompt_tokens(requests)}
    if output.index:
        entry["i"] = output.index
    if output.error:
        entry["error"] = output.error
    return entry


def delta_entry(output):
    entry = {"t": "delta", "text": output.text, "n": output.completion_tokens}
    if output.index:
        entry["i"] = output.index
    if output.logprobs:
        entry["logprobs"] = output.logprobs
    return entry


def wait_until_finished(outbox, running):
    deadline = time.monotonic() + DRAIN_SECONDS
    while running and time.monotonic() < deadline:
        try:
            running -= outbox.get(timeout=1).finished
        except queue.Empty:
            pass


# The ledger has one status per request: with n > 1, the worst of its choices' endings.
WORST_FIRST = ("error", "cancelled", "length", "stop")


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
        tokenizer=tokenizer_id,
        prompt_tokens=prompt_tokens(requests),
        completion_tokens=completion_tokens(requests),
        error=errors[0] if errors else "",
        received_at=ledger.as_datetime(received_at),
        started_at=earliest(r.started_at for r in requests),
        first_token_at=earliest(r.first_token_at for r in requests),
        finished_at=ledger.as_datetime(max((r.finished_at or time.time()) for r in requests)),
    )


def end_entry(requests):
    """The last log entry: the same counts the ledger entry was given, and each choice's ending."""
    prompt, completion = prompt_tokens(requests), completion_tokens(requests)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    end = {"t": "end", "finish_reasons": [r.finish_reason or "error" for r in requests], "usage": usage}
    errors = [r.error for r in requests if r.error]
    if errors:
        end["error"] = errors[0]
    return end
