import hashlib
import secrets

from django.conf import settings
from django.db import models

KEY_PREFIX = "tsk-"


def hash_key(raw):
    # Keys are 256 random bits: a plain SHA-256 is enough, no slow hash needed.
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiKey(models.Model):
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, help_text="The visible start of the key, to recognise it.")
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: no limit.")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Prompt plus max_tokens of each request admitted; empty: no limit."
    )

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def issue(cls, name, user=None):
        """Create a key; the raw key is returned once and never stored."""
        key = cls(name=name, user=user)
        raw = key.new_secret()
        key.save()
        return key, raw

    def new_secret(self):
        raw = KEY_PREFIX + secrets.token_urlsafe(32)
        self.prefix, self.key_hash = raw[:12], hash_key(raw)
        return raw

    @classmethod
    def authenticate(cls, raw):
        return cls.objects.filter(key_hash=hash_key(raw), revoked_at__isnull=True).first()

    @classmethod
    def from_authorization(cls, header):
        """The live key named by an `Authorization: Bearer KEY` header, or None."""
        scheme, _, raw = header.partition(" ")
        if scheme.lower() != "bearer" or not raw.strip():
            return None
        return cls.authenticate(raw.strip())


class AppendOnlyError(Exception):
    pass


class UsageEntry(models.Model):
    """One row per request, written once by the worker: the ledger."""

    class Status(models.TextChoices):
        COMPLETED = "completed"
        LENGTH = "length"
        CANCELLED = "cancelled"
        FAILED = "failed"

    request_id = models.CharField(max_length=64, unique=True)
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.PROTECT)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT)
    model = models.CharField(max_length=100)
    tokenizer = models.CharField(max_length=120, help_text="Tokenizer name and a hash of its files.")
    prompt_tokens = models.PositiveIntegerField(help_text="Ids fed to the model.")
    completion_tokens = models.PositiveIntegerField(help_text="Ids the model produced.")
    finish_reason = models.CharField(max_length=20)
    status = models.CharField(max_length=20, choices=Status.choices)
    error = models.TextField(blank=True)
    received_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField()

    class Meta:
        ordering = ["-received_at"]
        verbose_name_plural = "usage entries"

    def __str__(self):
        return self.request_id

    @property
    def total_tokens(self):
        return self.prompt_tokens + self.completion_tokens

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError("ledger entries are never changed; add a correcting entry instead")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError("ledger entries are never deleted")
