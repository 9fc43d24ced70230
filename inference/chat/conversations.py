"""The chat page's conversations: the messages a reply is asked with, and the chats and turns
the page shows (a reply still streaming is settled first: inference/replies.py)."""

import json
import logging

from django.db import transaction

from billing.models import UsageEntry
from inference import backends, streamlog
from inference.gateway import prompt_count
from inference.gateway.admission import Owner, admit
from inference.models import TITLE_CHARS, Chat, Turn
from inference.protocol import chat_request
from inference.protocol.errors import ApiError, invalid
from inference.replies import settle

log = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 32000
PARAMETERS = ("model", "temperature", "max_tokens", "seed", "tools")  # passed on as the API takes them


def messages_of(chat, new_user_text=None, turns=None):
    """The conversation as the model reads it (`turns`: the chat's, unless given): replies that
    produced no text (a stop before the first token, a failure) are left out."""
    messages = [{"role": "system", "content": chat.system_prompt}] if chat.system_prompt else []
    for turn in (chat.turns.all() if chat.pk else []) if turns is None else turns:
        if turn.role == Turn.USER or turn.content:
            messages.append({"role": turn.role, "content": turn.content})
    if new_user_text is not None:
        messages.append({"role": "user", "content": new_user_text})
    return messages


def checked_text(value, param, required=True):
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()) or len(value) > MAX_MESSAGE_CHARS:
        raise invalid(f"`{param}` must be {'non-empty ' if required else ''}text of at most {MAX_MESSAGE_CHARS} characters.", param=param)
    return value


def ask(user, chat, messages, body):
    """Check and queue a reply to `messages` with the page's parameters; nothing is written
    when it is refused."""
    request = chat_request.parse(request_json(body, messages, stream=True), "application/json", backends.CATALOG)
    return request.model, admit(request, Owner(user_id=user.pk))


def request_json(body, messages, **extra):
    """A chat completion body: the page's parameters, as the API takes them, and `messages`."""
    payload = {name: body[name] for name in PARAMETERS if body.get(name) is not None}
    return json.dumps({**payload, "messages": messages, **extra})


def count_message(user, chat, body):
    """What sending `content` now would cost: /v1/tokenize's answer for the whole conversation."""
    content = checked_text(body.get("content"), "content", required=False)
    system = chat.system_prompt if chat else checked_text(body.get("system_prompt"), "system_prompt", required=False)
    messages = messages_of(chat or Chat(system_prompt=system), content)
    return prompt_count.tokenize(request_json(body, messages), "application/json")


def title_of(text):
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


def post_message(user, chat, body):
    """A user message and the reply it asks for; a new chat (chat None) is made with them."""
    content = checked_text(body.get("content"), "content")
    system = chat.system_prompt if chat else checked_text(body.get("system_prompt"), "system_prompt", required=False)
    with transaction.atomic():  # one reply at a time per chat, whatever other tabs do
        chat = locked_idle(chat)
        model, admitted = ask(user, chat, messages_of(chat or Chat(system_prompt=system), content), body)
        with undo_on_failure(admitted.request_id), transaction.atomic():
            if chat is None:
                chat = Chat.objects.create(user=user, title=title_of(content), system_prompt=system)
            user_turn = Turn.objects.create(chat=chat, role=Turn.USER, content=content)
            reply = Turn.objects.create(chat=chat, role=Turn.ASSISTANT, request_id=admitted.request_id, model=model)
            keep_settings(chat, body)
    return chat, [user_turn, reply], admitted


def keep_settings(chat, body):
    """The chat remembers the model and parameters it was last sent with: reopened, it has them."""
    chat.settings = {name: body[name] for name in PARAMETERS if body.get(name) is not None}
    chat.save(update_fields=["settings", "updated_at"])


def rename(chat, body):
    chat.title = title_of(checked_text(body.get("title"), "title"))
    chat.save(update_fields=["title", "updated_at"])
    return chat


def delete(chat):
    """The chat and its turns go; the ledger keeps every entry its replies wrote."""
    with transaction.atomic():
        locked_idle(chat).delete()


def regenerate(user, chat, body):
    """A new reply in place of the last one, to the same conversation."""
    with transaction.atomic():
        chat = locked_idle(chat)
        last = chat.turns.last()
        if last is None or last.role != Turn.ASSISTANT:
            raise ApiError(409, "There is no reply to regenerate.", code="nothing_to_regenerate")
        earlier = messages_of(chat)
        if last.content:
            earlier.pop()
        model, admitted = ask(user, chat, earlier, body)
        with undo_on_failure(admitted.request_id), transaction.atomic():
            last.delete()
            reply = Turn.objects.create(chat=chat, role=Turn.ASSISTANT, request_id=admitted.request_id, model=model)
            keep_settings(chat, body)
    return chat, [reply], admitted


def edit_last(user, chat, body):
    """The last user message replaced by `content`, with a new reply to it: the old message and
    its reply leave the chat (their ledger entries stay, as every entry does)."""
    content = checked_text(body.get("content"), "content")
    with transaction.atomic():
        chat = locked_idle(chat)
        asked = chat.turns.filter(role=Turn.USER).last()
        if asked is None:
            raise ApiError(409, "There is no message to edit.", code="nothing_to_edit")
        model, admitted = ask(user, chat, messages_of(chat, content, chat.turns.filter(pk__lt=asked.pk)), body)
        with undo_on_failure(admitted.request_id), transaction.atomic():
            chat.turns.filter(pk__gte=asked.pk).delete()
            user_turn = Turn.objects.create(chat=chat, role=Turn.USER, content=content)
            reply = Turn.objects.create(chat=chat, role=Turn.ASSISTANT, request_id=admitted.request_id, model=model)
            keep_settings(chat, body)
    return chat, [user_turn, reply], admitted


def locked_idle(chat):
    """The chat, locked until the transaction ends, once no reply of it is still streaming."""
    if chat is None:
        return None
    chat = Chat.objects.select_for_update().get(pk=chat.pk)
    check_idle(chat)
    return chat


class undo_on_failure:
    """The request was queued before its turns were written: if writing them fails, stop it."""

    def __init__(self, request_id):
        self.request_id = request_id

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None:
            streamlog.cancel(streamlog.sync_client(), self.request_id, "unsaved")


def check_idle(chat):
    for turn in chat.turns.filter(role=Turn.ASSISTANT, finish_reason=""):
        settle(turn)
        if turn.streaming:
            raise ApiError(409, "A reply is still being written in this chat: stop it or wait for it.", code="reply_in_progress")


def events_url(request_id):
    return f"/v1/chat/completions/{request_id}/events"


def turn_json(turn, entry=None):
    data = {
        "id": turn.pk,
        "role": turn.role,
        "content": turn.content,
        "tool_calls": turn.tool_calls,
        "steering": turn.steering,
        "request_id": turn.request_id,
        "model": turn.model,
        "finish_reason": turn.finish_reason,
        "error": turn.error,
    }
    if turn.streaming:
        data["events_url"] = events_url(turn.request_id)
    if entry is not None:
        data["usage"] = usage_json(entry)
    return data


def usage_json(entry):
    """The numbers the page shows under a reply, all from its ledger entry."""
    return {
        "prompt_tokens": entry.prompt_tokens,
        "completion_tokens": entry.completion_tokens,
        "total_tokens": entry.total_tokens,
        "cached_prompt_tokens": entry.cached_prompt_tokens,
        "cost": decimal_text(entry.total_cost),
        "input_cost": decimal_text(entry.input_cost),
        "cached_input_cost": decimal_text(entry.cached_input_cost),
        "output_cost": decimal_text(entry.output_cost),
        "currency": entry.currency,
        "time_to_first_token_ms": None if entry.time_to_first_token is None else round(entry.time_to_first_token * 1000),
        "tokens_per_second": None if entry.tokens_per_second is None else round(entry.tokens_per_second, 1),
        "status": entry.status,
        "why": entry.error,  # a failure's error, or who cancelled it
    }


def decimal_text(value):
    return None if value is None else format(value.normalize(), "f")


def turns_json(chat):
    """Every turn, settling replies that ended; each reply with its ledger entry's numbers."""
    turns = list(chat.turns.all())
    for turn in turns:
        settle(turn)
    entries = UsageEntry.objects.in_bulk([t.request_id for t in turns if t.request_id], field_name="request_id")
    return [turn_json(turn, entries.get(turn.request_id)) for turn in turns]


def chat_json(chat):
    return {"id": chat.pk, "title": chat.title, "url": f"/c/{chat.pk}", "updated_at": chat.updated_at.isoformat(), "settings": chat.settings}
