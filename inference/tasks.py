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

from . import streamlog
from .engine import Request, SamplingParams
from .worker import engine_loop

log = logging.getLogger(__name__)
DRAIN_SECONDS = 30


@shared_task(name="inference.tasks.generate")
def generate(request_id, model, prompt_ids, params, received_at, api_key_id=None, user_id=None):
    if UsageEntry.objects.filter(request_id=request_id).exists():
        return  # a second delivery of a request already recorded
    request = Request(request_id, prompt_ids, SamplingParams(**params))
    client = streamlog.sync_client()
    tokenizer_id = ""
    try:
        loop = engine_loop(model)
        tokenizer_id = loop.model.tokenizer_id
        relay(loop, request, client)
    except Exception as exc:
        log.exception("request %s failed", request_id)
        request.finish_reason, request.error = "error", f"generation failed: {exc}"
    finally:
        try:
            record(request, model, tokenizer_id, received_at, api_key_id, user_id)
        except Exception:  # the client still gets its end; the operator gets the alarm
            log.critical("no ledger entry could be written for request %s", request_id, exc_info=True)
        streamlog.append(client, request_id, end_entry(request))


def relay(loop, request, client):
    """Copy the engine's outputs to the log until the request finishes."""
    outbox = loop.submit(request)
    try:
        while True:
            output = outbox.get()
            if output.text or output.logprobs:
                streamlog.append(client, request.request_id, delta_entry(output))
            if output.finished:
                return
    except Exception:
        # The log cannot take more: stop the engine too, and bill what it did up to then.
        loop.engine.cancel(request.request_id)
        wait_until_finished(outbox)
        raise


def delta_entry(output):
    entry = {"t": "delta", "text": output.text, "n": output.completion_tokens}
    if output.logprobs:
        entry["logprobs"] = output.logprobs
    return entry


def wait_until_finished(outbox):
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline:
        try:
            if outbox.get(timeout=1).finished:
                return
        except queue.Empty:
            pass


def record(request, model, tokenizer_id, received_at, api_key_id, user_id):
    return ledger.record(
        request.request_id,
        request.finish_reason or "error",
        api_key_id=api_key_id,
        user_id=user_id,
        model=model,
        tokenizer=tokenizer_id,
        prompt_tokens=request.prefilled,
        completion_tokens=len(request.output_ids),
        error=request.error or "",
        received_at=ledger.as_datetime(received_at),
        started_at=ledger.as_datetime(request.started_at),
        first_token_at=ledger.as_datetime(request.first_token_at),
        finished_at=ledger.as_datetime(request.finished_at or time.time()),
    )


def end_entry(request):
    """The last log entry: the same counts the ledger entry was given."""
    prompt, completion = request.prefilled, len(request.output_ids)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    end = {"t": "end", "finish_reason": request.finish_reason or "error", "usage": usage}
    if request.error:
        end["error"] = request.error
    return end
