"""End a request whose worker is gone: the end entry its readers wait for, and its ledger row.

The worker normally writes both. When it was killed, or no worker serves the model at all, a
reader of the stream notices (the worker's heartbeat expired) and ends the request in its place,
billing what the log shows was processed. Should the worker come back after all, its ledger
write finds this row (the request id is unique) and its late entries follow an end no reader
reads past.
"""

import json
import logging
import time

from billing import ledger

from . import limits, metrics, streamlog
from .admission import release_hold

log = logging.getLogger(__name__)


def end_abandoned(request_id, message):
    client = streamlog.sync_client()
    streamlog.cancel(client, request_id)  # should the worker be alive after all, it stops
    meta = streamlog.load_meta(client, request_id)
    if meta:
        limits.leave_queue(client, meta["model"], request_id)
    entries = [entry for _, entry in streamlog.read_all(client, request_id)]
    if not meta or any(entry["t"] == "end" for entry in entries):
        return
    usage = usage_so_far(meta, entries)
    try:
        record(request_id, meta, usage, message)
        release_hold(client, request_id, json.loads(meta.get("reservation") or "null"))
    except Exception:  # the readers still get their end; the operator gets the alarm
        log.critical("no ledger entry could be written for abandoned request %s", request_id, exc_info=True)
    try:
        metrics.record_request(client, meta["model"], "failed", {}, [], usage["prompt_tokens"], usage["completion_tokens"])
    except Exception:
        log.warning("metrics for abandoned request %s were not recorded", request_id, exc_info=True)
    end = {"t": "end", "finish_reasons": ["error"] * int(meta.get("n", 1)), "usage": usage, "error": message, "code": "worker_unavailable"}
    streamlog.append(client, request_id, end)


def usage_so_far(meta, entries):
    """The prompt counts once any output came (the model had read it); each choice's count of
    produced tokens is in its latest delta."""
    produced = {}
    for entry in entries:
        if entry["t"] == "delta":
            produced[entry.get("i", 0)] = entry["n"]
    prompt = int(meta["prompt_tokens"]) if produced else 0
    completion = sum(produced.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def record(request_id, meta, usage, message):
    received = float(meta.get("received_at") or 0) or time.time()
    ledger.record(
        request_id,
        "error",
        api_key_id=int(meta["api_key_id"]) if meta.get("api_key_id") else None,
        user_id=int(meta["user_id"]) if meta.get("user_id") else None,
        model=meta["model"],
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        usage_source="stream_log",  # the worker is gone: its last deltas say what it produced
        error=message,
        received_at=ledger.as_datetime(received),
        finished_at=ledger.as_datetime(time.time()),
    )
