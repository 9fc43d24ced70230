"""The API's plain Django routes (the streaming ones are ASGI apps: inference/gateway/routing.py)."""

from django.urls import path

from inference.gateway import views

urlpatterns = [
    path("v1/chat/completions/<str:request_id>/cancel", views.api_cancel, name="api-cancel"),
    path("v1/chat/completions/<str:request_id>/steer", views.api_steer, name="api-steer"),
    path("v1/models", views.models, name="models"),
    path("v1/tokenize", views.api_tokenize, name="api-tokenize"),
    path("healthz", views.healthz, name="healthz"),
    path("metrics", views.prometheus_metrics, name="metrics"),
]
