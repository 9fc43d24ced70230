from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path
from drf_spectacular.views import SpectacularAPIView

from billing import api
from inference import chat_views, views

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
