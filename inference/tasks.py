"""The Celery side: run one request on this process's engine and relay it to the Redis log."""

import logging
import time

from celery import shared_task

from billing import ledger
from billing.models import UsageEntry

from . import streamlog
from .engine import Request, SamplingParams
from .worker import engine_loop

log = logging.getLogger(__name__)


@shared_task(name="inference.tasks.generate")
def generate(request_id, model, prompt_ids, params, received_at, api_key_id=None, user_id=None):
    if UsageEntry.objects.filter(request_id=request_id).exists():
        return  # a second delivery of a request already recorded
    request = Request(request_id, prompt_ids, SamplingParams(**params))
    client = streamlog.sync_client()
    try:
        loop = engine_loop(model)
        tokenizer_id = loop.model.tokenizer_id
        final = relay(loop.submit(request), client, request_id)
    except Exception as exc:
        log.exception("request %s failed", request_id)
        tokenizer_id, final = "", None
        request.finish_reason, request.error = "error", f"generation failed: {exc}"
    entry = ledger.record(
        request_id,
        final.finish_reason if final else "error",
        api_key_id=api_key_id,
        user_id=user_id,
        model=model,
        tokenizer=tokenizer_id,
        prompt_tokens=request.prefilled,
        completion_tokens=len(request.output_ids),
        error=(final.error if final else request.error) or "",
        received_at=ledger.as_datetime(received_at),
        started_at=ledger.as_datetime(request.started_at),
        first_token_at=ledger.as_datetime(request.first_token_at),
        finished_at=ledger.as_datetime(request.finished_at or time.time()),
    )
    streamlog.append(client, request_id, end_entry(entry))


def relay(outbox, client, request_id):
    """Copy the engine's outputs to the log until the last one; returns that one."""
    while True:
        output = outbox.get()
        if output.text:
            streamlog.append(client, request_id, {"t": "delta", "text": output.text, "n": output.completion_tokens})
        if output.finished:
            return output


def end_entry(entry):
    end = {"t": "end", "finish_reason": entry.finish_reason, "usage": entry.usage()}
    if entry.error:
        end["error"] = entry.error
    return end
