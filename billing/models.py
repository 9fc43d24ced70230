import hashlib
import json
import secrets
from decimal import Decimal

from django.conf import settings
from django.db import models
from django.utils import timezone

KEY_PREFIX = "tsk-"
SCOPES = {"chat", "ledger:read", "ledger:read:all"}


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
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: never.")
    scopes = models.CharField(max_length=100, default="chat", help_text="Space-separated: chat, ledger:read (its own entries), ledger:read:all.")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: no limit.")
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True, help_text="Prompt plus max_tokens of each request admitted; empty: no limit.")

    def __str__(self):
        return f"{self.name} ({self.prefix}…)"

    @classmethod
    def issue(cls, name, user=None, scopes="chat"):
        """Create a key; the raw key is returned once and never stored."""
        key = cls(name=name, user=user, scopes=scopes)
        raw = key.new_secret()
        key.save()
        return key, raw

    def new_secret(self):
        raw = KEY_PREFIX + secrets.token_urlsafe(32)
        self.prefix, self.key_hash = raw[:12], hash_key(raw)
        return raw

    @classmethod
    def authenticate(cls, raw):
        """The key, if it exists, is not revoked and has not expired."""
        live = models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=timezone.now())
        return cls.objects.filter(live, key_hash=hash_key(raw), revoked_at__isnull=True).first()

    def has_scope(self, scope):
        return scope in self.scopes.split()

    @classmethod
    def from_authorization(cls, header):
        """The live key named by an `Authorization: Bearer KEY` header, or None."""
        scheme, _, raw = header.partition(" ")
        if scheme.lower() != "bearer" or not raw.strip():
            return None
        return cls.authenticate(raw.strip())


class AppendOnlyError(Exception):
    pass


class AppendOnly(models.Model):
    """Rows that are added, never changed or deleted."""

    class Meta:
        abstract = True

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyError(f"{self._meta.verbose_name_plural} are never changed; add a new one instead")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyError(f"{self._meta.verbose_name_plural} are never deleted")


COST_PLACES = Decimal("0.000000001")  # stored exactly so, so that the hash of an entry reads back the same
MILLION = Decimal(1_000_000)


class PriceSheet(AppendOnly):
    """A model's prices from `effective_from` on; a new price is a new sheet."""

    model = models.CharField(max_length=100)
    input_per_million = models.DecimalField(max_digits=14, decimal_places=6)
    cached_input_per_million = models.DecimalField(max_digits=14, decimal_places=6)
    output_per_million = models.DecimalField(max_digits=14, decimal_places=6)
    currency = models.CharField(max_length=3, default="USD")
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model", "-effective_from"]
        constraints = [models.UniqueConstraint(fields=["model", "effective_from"], name="one_sheet_per_model_and_time")]

    def __str__(self):
        return f"{self.model} from {self.effective_from:%Y-%m-%d %H:%M}"

    @classmethod
    def in_force(cls, model, at):
        return cls.objects.filter(model=model, effective_from__lte=at).order_by("-effective_from").first()

    def costs(self, prompt_tokens, cached_prompt_tokens, completion_tokens):
        def cost(tokens, per_million):
            return (Decimal(tokens) * per_million / MILLION).quantize(COST_PLACES)

        parts = {
            "input_cost": cost(prompt_tokens - cached_prompt_tokens, self.input_per_million),
            "cached_input_cost": cost(cached_prompt_tokens, self.cached_input_per_million),
            "output_cost": cost(completion_tokens, self.output_per_million),
        }
        return {**parts, "total_cost": sum(parts.values()), "currency": self.currency, "price_sheet": self}


class UsageEntry(AppendOnly):
    """One row per request, written once by the worker: the ledger. Each row's hash covers its
    content and the previous row's hash, so an edit anywhere shows (manage.py verify_ledger)."""

    class Status(models.TextChoices):
        COMPLETED = "completed"
        LENGTH = "length"
        TOOL_CALLS = "tool_calls"
        CANCELLED = "cancelled"
        FAILED = "failed"

    class Kind(models.TextChoices):
        USAGE = "usage"
        ADJUSTMENT = "adjustment"
        REVERSAL = "reversal"

    request_id = models.CharField(max_length=64, unique=True)
    kind = models.CharField(max_length=12, choices=Kind.choices, default=Kind.USAGE)
    corrects = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, help_text="The entry an adjustment or reversal corrects.")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.PROTECT)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT)
    model = models.CharField(max_length=100)
    tokenizer = models.CharField(max_length=120, help_text="Tokenizer name and a hash of its files.")
    model_served = models.CharField(max_length=100, blank=True)
    # Signed, so that a correction can take back: a usage entry's counts are never negative
    # (a constraint says so), a reversal's are the negated counts of the entry it reverses.
    prompt_tokens = models.IntegerField(help_text="Ids fed to the model, steering included.")
    cached_prompt_tokens = models.IntegerField(default=0, help_text="Of those, served from the prefix cache.")
    steering_tokens = models.IntegerField(default=0, help_text="Of those, injected while it ran.")
    completion_tokens = models.IntegerField(help_text="Ids the model produced.")
    usage_source = models.CharField(
        max_length=20,
        default="engine_ids",
        help_text="How the counts were obtained: engine_ids (the ids our model read and wrote), upstream (the upstream's "
        "usage, as its invoice will say), estimate (an upstream that reported none: our count), stream_log, correction.",
    )
    # An upstream vendor's own report of the request (empty for local models, and for an upstream
    # that reported none); when it reported, the counts above are its counts.
    vendor_request_id = models.CharField(max_length=100, blank=True, db_index=True, help_text="The upstream's id of the request.")
    vendor_prompt_tokens = models.IntegerField(null=True, blank=True)
    vendor_cached_prompt_tokens = models.IntegerField(null=True, blank=True)
    vendor_completion_tokens = models.IntegerField(null=True, blank=True)
    # Our own count of a relayed request, from its text with the upstream's tokenizer: the
    # cross-check of the vendor's (empty for local models, whose counts are the ids themselves).
    counted_prompt_tokens = models.IntegerField(null=True, blank=True, help_text="Our count of the prompt, for a relayed request.")
    counted_completion_tokens = models.IntegerField(null=True, blank=True, help_text="Our count of the reply, for a relayed request.")
    counts_differ = models.BooleanField(
        null=True, blank=True, default=None, db_index=True,
        help_text="Whether the vendor's counts differ from ours; empty when nothing was compared (a local model, or no vendor usage).",
    )  # fmt: skip
    finish_reason = models.CharField(max_length=20)
    status = models.CharField(max_length=20, choices=Status.choices)
    error = models.TextField(blank=True)
    received_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField()
    price_sheet = models.ForeignKey(PriceSheet, null=True, blank=True, on_delete=models.PROTECT)
    # Empty costs mean unknown (no price sheet for the model), never zero.
    input_cost = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)
    cached_input_cost = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)
    output_cost = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)
    total_cost = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)
    currency = models.CharField(max_length=3, blank=True)
    previous_hash = models.CharField(max_length=64, blank=True, editable=False)
    entry_hash = models.CharField(max_length=64, blank=True, editable=False)

    class Meta:
        ordering = ["-received_at"]
        verbose_name_plural = "usage entries"
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(kind="usage")
                | models.Q(prompt_tokens__gte=0, completion_tokens__gte=0, cached_prompt_tokens__gte=0, steering_tokens__gte=0),
                name="usage_counts_are_not_negative",
            ),
            models.CheckConstraint(condition=models.Q(kind="usage") | models.Q(corrects__isnull=False), name="a_correction_names_its_entry"),
        ]

    def __str__(self):
        return self.request_id

    @property
    def total_tokens(self):
        return self.prompt_tokens + self.completion_tokens

    @property
    def time_to_first_token(self):
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.received_at).total_seconds()

    @property
    def queued_ms(self):
        return milliseconds(self.received_at, self.started_at)

    @property
    def first_token_after_start_ms(self):
        """The reply's own wait for its first token, apart from the queue (time_to_first_token,
        the page's, is what its user waited from the request)."""
        return milliseconds(self.started_at, self.first_token_at)

    @property
    def duration_ms(self):
        return milliseconds(self.received_at, self.finished_at)

    @property
    def tokens_per_second(self):
        if self.first_token_at is None or self.finished_at <= self.first_token_at:
            return None
        return self.completion_tokens / (self.finished_at - self.first_token_at).total_seconds()

    def content_hash(self):
        return content_hash(self)


def milliseconds(start, end):
    return None if start is None or end is None else round((end - start).total_seconds() * 1000)


# The fields an entry's hash covers, fixed: a column added later must not change the hashes of
# the entries already written (a new field joins through a new version of this list).
HASHED_FIELDS = (
    "request_id", "kind", "corrects_id", "api_key_id", "user_id", "model", "model_served", "tokenizer",
    "prompt_tokens", "cached_prompt_tokens", "steering_tokens", "completion_tokens", "usage_source",
    "finish_reason", "status", "error", "received_at", "started_at", "first_token_at", "finished_at",
    "price_sheet_id", "input_cost", "cached_input_cost", "output_cost", "total_cost", "currency", "previous_hash",
)  # fmt: skip


# Fields added later join the hash only when they hold a value, so earlier hashes stay true.
HASHED_WHEN_SET = (
    "vendor_request_id", "vendor_prompt_tokens", "vendor_cached_prompt_tokens", "vendor_completion_tokens",
    "counted_prompt_tokens", "counted_completion_tokens",
)  # fmt: skip


def content_hash(entry):
    """sha256 over the entry's content and the previous entry's hash (any model class with
    these fields: the migrations use it too)."""
    content = {name: hashable(getattr(entry, name)) for name in HASHED_FIELDS}
    content.update({name: getattr(entry, name) for name in HASHED_WHEN_SET if getattr(entry, name, None) not in (None, "")})
    text = json.dumps(content, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def hashable(value):
    if value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, Decimal):
        return str(value.quantize(COST_PLACES))
    return value.isoformat()  # datetimes, stored and read back in UTC


class Budget(models.Model):
    """A limit on what a key (or a user, whose keys and chat page it covers) may spend per day
    or month, and what its admitted, unfinished requests hold against it."""

    class Period(models.TextChoices):
        DAY = "day"
        MONTH = "month"

    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE)
    period = models.CharField(max_length=5, choices=Period.choices, default=Period.MONTH)
    token_limit = models.PositiveBigIntegerField(null=True, blank=True, help_text="Prompt plus completion tokens; empty: no limit.")
    money_limit = models.DecimalField(max_digits=14, decimal_places=6, null=True, blank=True, help_text="Empty: no limit.")
    held_tokens = models.PositiveBigIntegerField(default=0, editable=False)
    held_money = models.DecimalField(max_digits=20, decimal_places=9, default=0, editable=False)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(api_key__isnull=False) | models.Q(user__isnull=False), name="budget_has_an_owner"),
        ]

    def __str__(self):
        return f"{self.api_key or self.user}: per {self.period}"

    def period_start(self, now):
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start.replace(day=1) if self.period == self.Period.MONTH else start

    def spent(self, now):
        """(tokens, money) of the ledger's entries for this owner in the current period."""
        owner = models.Q(api_key=self.api_key) if self.api_key_id else models.Q(user=self.user)
        totals = UsageEntry.objects.filter(owner, received_at__gte=self.period_start(now)).aggregate(
            tokens=models.Sum(models.F("prompt_tokens") + models.F("completion_tokens")), money=models.Sum("total_cost")
        )
        return totals["tokens"] or 0, totals["money"] or Decimal(0)


class Invoice(models.Model):
    """A vendor's usage export, imported once: the same file again changes nothing."""

    class Granularity(models.TextChoices):
        REQUEST = "request", "per request"
        DAY = "day", "per day and model"

    vendor = models.CharField(max_length=50)
    file_name = models.CharField(max_length=255)
    sha256 = models.CharField(max_length=64)
    granularity = models.CharField(max_length=10, choices=Granularity.choices)
    imported_at = models.DateTimeField(auto_now_add=True)
    imported_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)

    class Meta:
        ordering = ["-imported_at"]
        constraints = [models.UniqueConstraint(fields=["vendor", "sha256"], name="one_import_per_file")]

    def __str__(self):
        return f"{self.vendor}: {self.file_name}"


class InvoiceLine(models.Model):
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    line_number = models.PositiveIntegerField(help_text="In the file, the header being line 1.")
    request_id = models.CharField(max_length=64, blank=True, db_index=True)
    day = models.DateField(null=True, blank=True)
    model = models.CharField(max_length=100, blank=True)
    input_tokens = models.BigIntegerField()
    cached_input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField()
    cost = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)

    class Meta:
        ordering = ["invoice", "line_number"]
