"""The streaming routes, served by ASGI apps of their own (why: inference/gateway/sse.py)."""

from channels.auth import AuthMiddlewareStack
from django.urls import path

from inference.gateway.sse import ChatCompletions, CompletionEvents

streaming_routes = [
    path("v1/chat/completions", ChatCompletions()),
    path("v1/chat/completions/<str:request_id>/events", AuthMiddlewareStack(CompletionEvents())),
]
