"""The chat page and its session endpoints (signed-in users, CSRF on every POST)."""

import functools

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, render
from django.views.decorators.http import require_GET

from inference import backends, registry
from inference.chat import conversations as chats
from inference.gateway.admission import Owner, admit
from inference.gateway.views import cancel, error_response, steer, steering_text
from inference.models import Chat
from inference.protocol import chat_request
from inference.protocol.errors import ApiError, not_found, too_large

# The page runs only its own script: model output that slipped through the sanitizer still
# could not run, load a remote image or send anything anywhere.
MAX_LISTED = 200
PAGE_CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


def session_api(method):
    """A signed-in user's JSON endpoint for one HTTP method: errors in the OpenAI shape."""
    return functools.partial(session_api_view, method=method)


def session_api_view(view, method):
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        try:
            if not request.user.is_authenticated:
                raise ApiError(401, "Sign in first: this endpoint belongs to the chat page.", type="invalid_request_error", code="not_signed_in")
            if request.method != method:
                raise ApiError(405, f"Use {method}.", code="method_not_allowed")
            return view(request, *args, **kwargs)
        except RequestDataTooBig:
            return error_response(too_large(settings.TOKSTREAM_MAX_BODY_BYTES))
        except ApiError as exc:
            return error_response(exc)

    return wrapper


def json_body(request):
    return chat_request.json_object(request.body or b"{}")


def owned_chat(user, chat_id):
    chat = Chat.objects.filter(pk=chat_id, user=user).first() if str(chat_id).isdigit() else None
    if chat is None:
        raise not_found(f"No chat {chat_id} is yours.", param="chat")
    return chat


@login_required
@require_GET
def chat_page(request, chat_id=None):
    chat = get_object_or_404(Chat, pk=chat_id, user=request.user) if chat_id else None
    context = {
        "models": registry.names(),
        "chat": chat,
        "chat_data": chats.chat_json(chat) if chat else {"id": None},
        "chats": chat_list_json(request.user),
        "turns": chats.turns_json(chat) if chat else [],
    }
    response = render(request, "chat.html", context)
    response["Content-Security-Policy"] = PAGE_CSP
    return response


@session_api("GET")
def chat_list(request):
    return JsonResponse({"data": chat_list_json(request.user)})


def chat_list_json(user):
    """The side list: the user's newest chats."""
    return [chats.chat_json(c) for c in user.chats.all()[:MAX_LISTED]]


@session_api("GET")
def chat_detail(request, chat_id):
    chat = owned_chat(request.user, chat_id)
    return JsonResponse({**chats.chat_json(chat), "turns": chats.turns_json(chat)})


@session_api("POST")
def chat_rename(request, chat_id):
    return JsonResponse(chats.chat_json(chats.rename(owned_chat(request.user, chat_id), json_body(request))))


@session_api("POST")
def chat_delete(request, chat_id):
    chats.delete(owned_chat(request.user, chat_id))
    return JsonResponse({"id": int(chat_id), "deleted": True})


def reply_json(chat, turns, admitted):
    return JsonResponse(
        {
            "chat": chats.chat_json(chat),
            "turns": [chats.turn_json(turn) for turn in turns],
            "request_id": admitted.request_id,
            "events_url": chats.events_url(admitted.request_id),
            "prompt_tokens": admitted.prompt_tokens,
        }
    )


@session_api("POST")
def message_create(request, chat_id=None):
    chat = owned_chat(request.user, chat_id) if chat_id else None
    return reply_json(*chats.post_message(request.user, chat, json_body(request)))


@session_api("POST")
def reply_regenerate(request, chat_id):
    return reply_json(*chats.regenerate(request.user, owned_chat(request.user, chat_id), json_body(request)))


@session_api("POST")
def message_edit(request, chat_id):
    """The last user message, edited and sent again: it and its reply are replaced."""
    return reply_json(*chats.edit_last(request.user, owned_chat(request.user, chat_id), json_body(request)))


@session_api("POST")
def chat_create(request):
    """A bare completion for the signed-in user (no chat kept): same checks and queue as the API."""
    admitted = admit(chat_request.parse(request.body, request.content_type, backends.CATALOG), Owner(user_id=request.user.pk))
    return JsonResponse({"id": admitted.request_id, "events_url": chats.events_url(admitted.request_id), "prompt_tokens": admitted.prompt_tokens})


@session_api("POST")
def chat_tokenize(request):
    """What the composer's message would cost in its chat (`chat`: an id, or none for a new one), as the user types."""
    body = json_body(request)
    chat = owned_chat(request.user, body["chat"]) if body.get("chat") else None
    return JsonResponse(chats.count_message(request.user, chat, body))


@session_api("POST")
def chat_cancel(request, request_id):
    return cancel(Owner(user_id=request.user.pk), request_id)


@session_api("POST")
def chat_steer(request, request_id):
    return steer(Owner(user_id=request.user.pk), request_id, steering_text(request.body))
