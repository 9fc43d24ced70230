"""The Celery task: claim one request, then run it on this process's engine (worker/local.py)
or relay it from its upstream (worker/relay.py).

Whatever happens, the request ends with exactly one ledger entry and an end entry in its log,
so no client is left waiting.
"""

from celery import shared_task

from inference import lifecycle, streamlog
from inference.protocol.payloads import GENERATE, GenerateTask
from inference.worker import process  # noqa: F401  (connects the worker process's signal receivers)
from inference.worker.engines import engine_loop
from inference.worker.local import run_locally
from inference.worker.relay import run_relayed


@shared_task(name=GENERATE)
def generate(**fields):
    task = GenerateTask(**fields)
    admitted = task.admitted()
    client = streamlog.sync_client()
    loop = engine_loop(task.model)
    relayed = task.upstream_body is not None
    verdict = lifecycle.claim(client, task.request_id, task.model, loop.worker_id, keep_queued=relayed)
    if verdict in (lifecycle.Claim.RUNNING, lifecycle.Verdict.ENDED):
        return  # a second delivery: the first is running it, or it is over
    if verdict != lifecycle.Claim.CLAIMED:
        # Its client left, its deadline passed, Redis lost it, or its worker died: never run.
        return lifecycle.end_abandoned(client, admitted, verdict)
    if relayed:
        return run_relayed(client, admitted, task.upstream_body, loop.worker_id, task.max_tokens)
    run_locally(client, loop, admitted, task.prompt_ids, task.params, task.tools)
