"""Plain Django views: the model list, health, metrics, and cancel and steer by request id."""

import functools
import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST

from inference import backends, lifecycle, metrics, registry, streamlog
from inference.gateway import prompt_count
from inference.gateway.admission import owned_meta
from inference.gateway.auth import required_owner
from inference.protocol.chat_request import is_text, json_object
from inference.protocol.errors import (
    ApiError,
    invalid,
    server_error,
    too_large,
)

MAX_STEER_CHARS = 8000
log = logging.getLogger(__name__)


def error_response(exc):
    return JsonResponse(exc.body(), status=exc.status, headers=exc.headers)


def api_key_required(view):
    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        try:
            required_owner(request.headers.get("Authorization", ""))
        except ApiError as exc:
            return error_response(exc)
        return view(request, *args, **kwargs)

    return wrapper


def api_post(view):
    """POST with a bearer key, errors in the OpenAI shape (a failure of ours too: an OpenAI
    client cannot read Django's HTML page). No CSRF: no cookie authenticates it."""

    @functools.wraps(view)
    def wrapper(request, *args, **kwargs):
        try:
            if request.method != "POST":
                raise ApiError(405, "Use POST.", code="method_not_allowed")
            return view(request, required_owner(request.headers.get("Authorization", "")), *args, **kwargs)
        except RequestDataTooBig:
            return error_response(too_large(settings.TOKSTREAM_MAX_BODY_BYTES))
        except ApiError as exc:
            return error_response(exc)
        except Exception:
            log.exception("%s failed", view.__name__)
            return error_response(server_error())

    return csrf_exempt(wrapper)


@require_GET
@api_key_required
def models(request):
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "tokstream"} for name in registry.names()]
    return JsonResponse({"object": "list", "data": data})


@require_GET
def prometheus_metrics(request):
    """Prometheus text format, for the whole service: the numbers live in Redis."""
    return HttpResponse(metrics.render(streamlog.sync_client()), content_type=CONTENT_TYPE_LATEST)


@require_GET
def healthz(request):
    checks = {"database": check(database_ok), "redis": check(redis_ok), "workers": check(workers_ok)}
    healthy = all(c["ok"] for c in checks.values())
    return JsonResponse({"status": "ok" if healthy else "unavailable", "checks": checks}, status=200 if healthy else 503)


def check(probe):
    try:
        return {"ok": True, **probe()}
    except Exception as exc:
        return {"ok": False, "error": str(exc)}


def database_ok():
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return {}


def redis_ok():
    streamlog.sync_client().ping()
    return {}


def workers_ok():
    beats = streamlog.workers(streamlog.sync_client())
    served, draining = streamlog.served_models(beats), streamlog.served_models(beats, draining=True)
    if not served:
        raise RuntimeError("every worker is draining: it finishes what it runs and takes nothing new" if draining else "no worker has a model loaded")
    return {"models": served, "draining": draining}


@api_post
def api_cancel(request, owner, request_id):
    return cancel(owner, request_id)


@api_post
def api_tokenize(request, owner):
    return JsonResponse(prompt_count.tokenize(request.body, request.content_type))


@api_post
def api_steer(request, owner, request_id):
    return steer(owner, request_id, steering_text(request.body))


def cancel(owner, request_id):
    """Idempotent: cancelling a finished request says so and changes nothing."""
    client = streamlog.sync_client()
    meta = owned_meta(streamlog.load_meta(client, request_id), owner, request_id)
    if streamlog.has_ended(client, request_id):
        status = "finished"
    else:
        streamlog.cancel(client, request_id)
        # Not yet taken by a worker: ended here and now, rather than when one reaches it.
        status = "cancelled" if lifecycle.end_if_over(client, request_id, meta.model) else "cancelling"
    return JsonResponse({"id": request_id, "object": "chat.completion.cancellation", "status": status})


def steer(owner, request_id, text):
    client = streamlog.sync_client()
    meta = owned_meta(streamlog.load_meta(client, request_id), owner, request_id)
    if not backends.of(meta.model).steerable:
        raise invalid(f"Steering is not supported for the upstream model `{meta.model}`: the vendor generates the reply.", param="content")
    if streamlog.has_ended(client, request_id):
        raise ApiError(409, f"Request {request_id!r} has finished: there is nothing left to steer.", code="request_finished")
    streamlog.steer(client, request_id, text)
    return JsonResponse({"id": request_id, "object": "chat.completion.steering", "status": "queued"}, status=202)


def steering_text(body):
    content = json_object(body, "The body must be a JSON object with `content`.").get("content")
    if not isinstance(content, str) or not content.strip() or len(content) > MAX_STEER_CHARS or not is_text(content):
        raise invalid(f"`content` must be non-empty text of at most {MAX_STEER_CHARS} characters.", param="content")
    return content
