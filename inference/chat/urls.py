from django.urls import path

from inference.chat import views

urlpatterns = [
    path("", views.chat_page, name="chat"),
    path("c/<int:chat_id>", views.chat_page, name="chat-page"),
    path("api/chats", views.chat_list, name="chat-list"),
    path("api/chats/messages", views.message_create, name="chat-start"),
    path("api/chats/count", views.chat_tokenize, name="chat-count"),
    path("api/chats/<int:chat_id>", views.chat_detail, name="chat-detail"),
    path("api/chats/<int:chat_id>/messages", views.message_create, name="chat-message"),
    path("api/chats/<int:chat_id>/regenerate", views.reply_regenerate, name="chat-regenerate"),
    path("api/chats/<int:chat_id>/edit", views.message_edit, name="chat-edit"),
    path("api/chats/<int:chat_id>/rename", views.chat_rename, name="chat-rename"),
    path("api/chats/<int:chat_id>/delete", views.chat_delete, name="chat-delete"),
    path("api/chat/completions", views.chat_create, name="chat-create"),
    path("api/chat/completions/<str:request_id>/cancel", views.chat_cancel, name="chat-cancel"),
    path("api/chat/completions/<str:request_id>/steer", views.chat_steer, name="chat-steer"),
]
