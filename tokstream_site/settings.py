import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from tokstream_site import config
from tokstream_site.env import local_secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
# Every variable the service reads, checked at once (tokstream_site/config.py declares them).
CONFIG = config.read(os.environ)
CACHE_DIR = CONFIG.site.cache_dir

DEBUG = CONFIG.site.debug
# Without SECRET_KEY, each installation makes its own once and keeps it in the cache folder, so
# a fresh checkout runs and no two installations share a key.
SECRET_KEY = CONFIG.site.secret_key or local_secret_key(CACHE_DIR / "secret_key")
ALLOWED_HOSTS = CONFIG.site.allowed_hosts
CSRF_TRUSTED_ORIGINS = CONFIG.site.csrf_trusted_origins

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
    url = CONFIG.site.database_url
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

REDIS_URL = CONFIG.site.redis_url

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
    "root": {"handlers": ["console"], "level": CONFIG.site.log_level},
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

# The code reads each TOKSTREAM_* setting under its variable's name (settings.TOKSTREAM_MAX_RUNNING).
globals().update(CONFIG.tokstream())

# The API reads bodies itself (inference.gateway.sse); the page's POST goes through Django: same limit.
DATA_UPLOAD_MAX_MEMORY_SIZE = CONFIG.admission.max_body_bytes
