from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.http import JsonResponse
from django.urls import path
from django.views import defaults
from drf_spectacular.views import SpectacularAPIView

from billing import api
from inference import chat_views, views
from inference.errors import not_found, server_error

API_PATHS = ("/v1/", "/api/")  # programs read errors there: OpenAI's JSON shape, never a page


def page_not_found(request, exception=None):
    if request.path.startswith(API_PATHS):
        return JsonResponse(not_found(f"No endpoint {request.path!r}.", code="unknown_url").body(), status=404)
    return defaults.page_not_found(request, exception)


def failed(request):
    if request.path.startswith(API_PATHS):
        return JsonResponse(server_error().body(), status=500)
    return defaults.server_error(request)


handler404 = page_not_found
handler500 = failed

urlpatterns = [
    path("", chat_views.chat_page, name="chat"),
    path("c/<int:chat_id>", chat_views.chat_page, name="chat-page"),
    path("api/chats", chat_views.chat_list, name="chat-list"),
    path("api/chats/messages", chat_views.message_create, name="chat-start"),
    path("api/chats/<int:chat_id>", chat_views.chat_detail, name="chat-detail"),
    path("api/chats/<int:chat_id>/messages", chat_views.message_create, name="chat-message"),
    path("api/chats/<int:chat_id>/regenerate", chat_views.reply_regenerate, name="chat-regenerate"),
    path("api/chat/completions", chat_views.chat_create, name="chat-create"),
    path("api/chat/completions/<str:request_id>/cancel", chat_views.chat_cancel, name="chat-cancel"),
    path("api/chat/completions/<str:request_id>/steer", chat_views.chat_steer, name="chat-steer"),
    path("v1/chat/completions/<str:request_id>/cancel", views.api_cancel, name="api-cancel"),
    path("v1/chat/completions/<str:request_id>/steer", views.api_steer, name="api-steer"),
    path("v1/models", views.models, name="models"),
    path("v1/tokenize", views.api_tokenize, name="api-tokenize"),
    path("api/chats/count", chat_views.chat_tokenize, name="chat-count"),
    path("api/ledger/entries/", api.Entries.as_view(), name="ledger-entries"),
    path("api/ledger/daily/", api.Daily.as_view(), name="ledger-daily"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("healthz", views.healthz, name="healthz"),
    path("metrics", views.prometheus_metrics, name="metrics"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
]
