"""Admit a checked chat request: count its prompt, reserve its log, queue it for a worker."""

import time
import uuid
from dataclasses import dataclass

from django.conf import settings

from . import limits, registry, streamlog, tools
from .chat_request import checked_max_tokens
from .engine.kv_cache import BLOCK_SIZE
from .errors import ApiError, not_found


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


@dataclass(frozen=True)
class Admitted:
    request_id: str
    model: str
    created: int
    prompt_tokens: int
    n: int = 1
    received_at: float = 0.0

    def meta(self, owner):
        """What the web processes keep of a request, enough to bill it should its worker die."""
        return {
            "owner": owner.label,
            "api_key_id": owner.api_key_id or "",
            "user_id": owner.user_id or "",
            "model": self.model,
            "created": self.created,
            "prompt_tokens": self.prompt_tokens,
            "n": self.n,
            "received_at": self.received_at,
        }

    @classmethod
    def from_meta(cls, request_id, meta):
        return cls(request_id, meta["model"], int(meta["created"]), int(meta["prompt_tokens"]))


def owned_meta(meta, owner, request_id):
    """The request's metadata if `owner` made it; otherwise it does not exist for them."""
    if not meta or meta["owner"] != owner.label:
        raise not_found(f"No request {request_id!r} is known.", param="id")
    return meta


def check_served(client, model):
    if model not in streamlog.served_models(streamlog.workers(client)):
        raise ApiError(503, f"No worker is serving `{model}` right now; try again shortly.", type="server_error", code="model_unavailable")


def prompt_ids(chat):
    try:
        tokenizer = registry.tokenizer(chat.model)
    except FileNotFoundError as exc:
        raise ApiError(503, f"The model `{chat.model}` is not available: {exc}", type="server_error") from None
    turns = tools.render(chat.messages, chat.tools)
    return list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True))


def admit(chat, owner):
    """Raises ApiError before anything is written; afterwards the request is queued."""
    from .tasks import generate

    received_at = time.time()
    ids = prompt_ids(chat)
    # A sequence never holds more than the worker's whole KV cache, whatever the model allows;
    # beams must all fit at once.
    cache_tokens = settings.TOKSTREAM_KV_CACHE_TOKENS // BLOCK_SIZE * BLOCK_SIZE  # as the pool rounds
    room = min(registry.context_length(chat.model), cache_tokens // chat.sampling["beam_width"])
    max_tokens = checked_max_tokens(chat, len(ids), room, settings.TOKSTREAM_DEFAULT_MAX_TOKENS)
    client = streamlog.sync_client()
    check_served(client, chat.model)
    limits.check_rate(client, owner, len(ids) + max_tokens * chat.n)
    admitted = Admitted(f"chatcmpl-{uuid.uuid4().hex}", chat.model, int(time.time()), len(ids), chat.n, received_at)
    position = limits.join_queue(client, chat.model, admitted.request_id)
    streamlog.save_meta(client, admitted.request_id, admitted.meta(owner))
    # The stream opens as OpenAI's does, with the role, and says where the request waits.
    streamlog.append(client, admitted.request_id, {"t": "open", "n": chat.n, "queue_position": position})
    params = {"max_tokens": max_tokens, **chat.sampling}
    task = {
        "request_id": admitted.request_id,
        "model": chat.model,
        "prompt_ids": ids,
        "params": params,
        "n": chat.n,
        "tools": bool(chat.tools),
        "received_at": received_at,
        "api_key_id": owner.api_key_id,
        "user_id": owner.user_id,
    }
    try:
        generate.apply_async(kwargs=task, queue="inference")
    except Exception:  # leave nothing half-made
        client.delete(streamlog.key(admitted.request_id, "meta"), streamlog.key(admitted.request_id, "log"))
        limits.leave_queue(client, chat.model, admitted.request_id)
        raise
    return admitted
