"""The chat page's conversations: kept on the server, so a reload shows the history."""

from django.conf import settings
from django.db import models

from inference.protocol.payloads import Admitted

TITLE_CHARS = 80


class Chat(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="chats")
    title = models.CharField(max_length=TITLE_CHARS)
    system_prompt = models.TextField(blank=True)
    settings = models.JSONField(default=dict, blank=True)  # the page's model and parameters, as last sent
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-updated_at"]
        indexes = [models.Index(fields=["user", "-updated_at"])]

    def __str__(self):
        return self.title


class Turn(models.Model):
    """A user message, or an assistant reply with the request that wrote it. A reply is
    settled (content, tool calls, ending) from the request's log when it ends."""

    USER, ASSISTANT = "user", "assistant"

    chat = models.ForeignKey(Chat, on_delete=models.CASCADE, related_name="turns")
    role = models.CharField(max_length=10, choices=[(USER, "user"), (ASSISTANT, "assistant")])
    content = models.TextField(blank=True)
    tool_calls = models.JSONField(default=list, blank=True)
    steering = models.JSONField(default=list, blank=True)  # [{"at": offset in content, "text": ...}]
    request_id = models.CharField(max_length=64, blank=True, db_index=True)
    model = models.CharField(max_length=100, blank=True)
    finish_reason = models.CharField(max_length=20, blank=True)  # empty while it streams
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self):
        return f"{self.role}: {self.content[:40]}"

    @property
    def streaming(self):
        return self.role == self.ASSISTANT and not self.finish_reason


class PendingRequest(models.Model):
    """An admitted request that has not ended yet. Written with its budget hold, removed with
    its ledger entry, in one transaction each: so a request lost with Redis (a restart loses
    the broker's queue) is still found, ended and billed once, and its hold given back."""

    request_id = models.CharField(max_length=64, unique=True)
    keyspace = models.CharField(max_length=16, db_index=True)  # which Redis and prefix hold its state
    model = models.CharField(max_length=100)
    api_key_id = models.BigIntegerField(null=True)
    user_id = models.BigIntegerField(null=True)
    prompt_tokens = models.IntegerField()
    n = models.IntegerField(default=1)
    received_at = models.FloatField()  # seconds since the epoch, as the task and log carry it
    hold = models.JSONField(null=True)  # billing.budgets.Hold.to_json(), released at the end
    task = models.JSONField(default=dict)  # the Celery task's arguments
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    def __str__(self):
        return self.request_id

    def admitted(self):
        return Admitted(self.request_id, self.model, int(self.received_at), self.prompt_tokens, self.n, self.received_at, self.api_key_id, self.user_id)
