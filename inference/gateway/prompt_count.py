"""Count a chat request without running it: its exact prompt tokens (the ids the model would
read, as admission counts them) and what it would cost at the price sheet in force."""

import time

from django.conf import settings
from django.utils import timezone

from billing.models import PriceSheet
from inference import backends
from inference.gateway.admission import prompt_of, room_for
from inference.protocol import chat_request
from inference.protocol.chat_request import checked_max_tokens


def tokenize(body, content_type):
    """The answer of POST /v1/tokenize; refusals are the chat endpoint's, word for word."""
    chat = chat_request.parse(body, content_type, backends.CATALOG)
    _, prompt_tokens = prompt_of(chat)
    max_tokens = checked_max_tokens(chat, prompt_tokens, room_for(chat), settings.TOKSTREAM_DEFAULT_MAX_TOKENS)
    return {
        "object": "tokenize",
        "model": chat.model,
        "tokenizer": backends.of(chat.model).tokenizer_id(),
        "prompt_tokens": prompt_tokens,
        # An upstream bills by its own usage: our count (of its template, or OpenAI's rules)
        # is what we expect it to say, not what it will.
        "estimate": backends.of(chat.model).engine is None,
        "max_tokens": max_tokens,
        "estimated_cost": estimate(chat.model, prompt_tokens, max_tokens * chat.n),
        "created": int(time.time()),
    }


def estimate(model, prompt_tokens, completion_budget):
    """Prompt cost (as if nothing were cached) and the most the completion could add; None
    when the model has no price sheet."""
    sheet = PriceSheet.in_force(model, timezone.now())
    if sheet is None:
        return None
    prompt = sheet.costs(prompt_tokens, 0, 0)["total_cost"]
    most = sheet.costs(prompt_tokens, 0, completion_budget)["total_cost"]
    return {"prompt": decimal_text(prompt), "at_most": decimal_text(most), "currency": sheet.currency}


def decimal_text(value):
    return format(value.normalize(), "f")
