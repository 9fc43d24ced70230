"""Admit a checked chat request: count its prompt, hold its budget, write its log's first entry, queue it for a worker."""

import dataclasses
import time
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction

from billing import budgets
from inference import backends, streamlog
from inference.gateway import limits
from inference.models import PendingRequest
from inference.protocol.chat_request import checked_max_tokens
from inference.protocol.entries import Open
from inference.protocol.errors import ApiError, not_found
from inference.protocol.payloads import GENERATE, Admitted, GenerateTask, RequestMeta
from tokstream_site.celery import app

UNSERVED_RETRY_SECONDS = 10  # a stopped worker's replacement has usually loaded by then


@dataclass(frozen=True)
class Owner:
    api_key_id: int | None = None
    user_id: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @classmethod
    def of_key(cls, key):
        return cls(key.pk, key.user_id, key.requests_per_minute, key.tokens_per_minute)

    @property
    def label(self):
        return f"key:{self.api_key_id}" if self.api_key_id else f"user:{self.user_id}"


def meta_of(admitted, owner, include_usage=False, continuous_usage=False):
    """What Redis keeps of a request beside its log, enough to bill it should its worker die."""
    return RequestMeta(
        owner.label, admitted.model, admitted.created, admitted.prompt_tokens, admitted.received_at,
        admitted.received_at + settings.TOKSTREAM_QUEUE_TIMEOUT, admitted.n, owner.api_key_id, owner.user_id, include_usage, continuous_usage,
    )  # fmt: skip


def owned_meta(meta, owner, request_id):
    """The request's metadata if `owner` made it; otherwise it does not exist for them."""
    if meta is None or meta.owner != owner.label:
        raise not_found(f"No request {request_id!r} is known.", param="id")
    return meta


def check_served(client, model):
    """A request is queued only where a worker will take it: not while the only workers of its
    model drain (asked to stop, they finish what they run and consume nothing more)."""
    beats = streamlog.workers(client)
    if model in streamlog.served_models(beats):
        return
    if model in streamlog.served_models(beats, draining=True):
        message = f"Every worker serving `{model}` is shutting down; try again shortly."
    else:
        message = f"No worker is serving `{model}` right now; try again shortly."
    raise ApiError(503, message, type="server_error", code="model_unavailable", headers={"Retry-After": str(UNSERVED_RETRY_SECONDS)})


def prompt_of(chat):
    """(the ids the local model will read, or None for an upstream; the prompt tokens billed)."""
    backend = backends.of(chat.model)
    backend.check(chat)
    return backend.prompt(chat)


def admit(chat, owner):
    """Raises ApiError before anything is written; afterwards the request is queued."""
    received_at = time.time()
    ids, prompt_tokens = prompt_of(chat)
    max_tokens = checked_max_tokens(chat, prompt_tokens, room_for(chat), settings.TOKSTREAM_DEFAULT_MAX_TOKENS)
    client = streamlog.sync_client()
    check_served(client, chat.model)
    limits.check_rate(client, owner, prompt_tokens + max_tokens * chat.n)
    admitted = Admitted(f"chatcmpl-{uuid.uuid4().hex}", chat.model, int(time.time()), prompt_tokens, chat.n, received_at, owner.api_key_id, owner.user_id)
    task = task_of(chat, admitted, owner, ids, max_tokens)
    pending = hold_budget(owner, admitted, task)
    try:
        enqueue(client, chat, admitted, owner, task)
    except Exception:  # leave nothing half-made
        with transaction.atomic():
            budgets.release(budgets.Hold.from_json(pending.hold))
            pending.delete()
        raise
    return admitted


def room_for(chat):
    return backends.of(chat.model).room(chat)


def hold_budget(owner, admitted, task):
    """The worst case held on every budget that applies, and the pending row that gives it
    back when the request ends, in one transaction."""
    completion_tokens = task.max_tokens * admitted.n
    try:
        with transaction.atomic():
            held = budgets.hold(owner.api_key_id, owner.user_id, admitted.model, admitted.prompt_tokens, completion_tokens)
            return PendingRequest.objects.create(
                request_id=admitted.request_id, keyspace=streamlog.keyspace(), model=admitted.model, api_key_id=owner.api_key_id, user_id=owner.user_id,
                prompt_tokens=admitted.prompt_tokens, n=admitted.n, received_at=admitted.received_at, hold=held.to_json(), task=task.as_kwargs(),
            )  # fmt: skip
    except budgets.OverBudget as exc:
        raise ApiError(429, f"You exceeded your budget: {exc}", type="insufficient_quota", code="insufficient_quota") from None


def task_of(chat, admitted, owner, ids, max_tokens):
    return GenerateTask(
        request_id=admitted.request_id,
        model=chat.model,
        prompt_ids=ids or [],
        prompt_tokens=admitted.prompt_tokens,
        upstream_body=backends.of(chat.model).upstream_body(chat, max_tokens),
        params=dataclasses.replace(chat.sampling, max_tokens=max_tokens),
        n=chat.n,
        tools=bool(chat.tools),
        received_at=admitted.received_at,
        api_key_id=admitted.api_key_id,
        user_id=admitted.user_id,
    )


def enqueue(client, chat, admitted, owner, task):
    position = limits.join_queue(client, chat.model, admitted.request_id)
    meta = meta_of(admitted, owner, chat.include_usage, chat.continuous_usage)
    # The stream opens as OpenAI's does, with the role, and says where the request waits.
    opening = Open(chat.n, position)
    try:
        streamlog.admit(client, admitted.request_id, meta, opening)
        # Celery's own repr of the arguments would read every prompt id, for a log line.
        app.send_task(GENERATE, kwargs=task.as_kwargs(), queue="inference", argsrepr="()", kwargsrepr=task.summary())
    except Exception:  # leave nothing half-made
        client.delete(*(streamlog.key(admitted.request_id, kind) for kind in ("meta", "log", "state")))
        streamlog.leave_queue(client, chat.model, admitted.request_id)
        raise
