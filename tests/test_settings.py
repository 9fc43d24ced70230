"""A bad setting stops start-up with a message that names the variable."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def start_with(**env):
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT, env={**os.environ, "DJANGO_SETTINGS_MODULE": "tokstream_site.settings", **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    "name,value",
    [
        ("DATABASE_URL", "not-a-url"),
        ("REDIS_URL", "http://127.0.0.1:6379"),
        ("DEBUG", "maybe"),
        ("TOKSTREAM_MAX_RUNNING", "lots"),
        ("TOKSTREAM_MAX_RUNNING", "0"),
        ("TOKSTREAM_MODELS", "{not json"),
        ("TOKSTREAM_MODELS", '{"m": "/models/m"}'),
        ("TOKSTREAM_DTYPE", "float8"),
        ("TOKSTREAM_WEIGHTS", "int3"),
        ("TOKSTREAM_DEVICE", "gpu0"),
        ("TOKSTREAM_DEVICE", "cuda:0,,cuda:1"),
        ("LOG_LEVEL", "LOUD"),
    ],
)
def test_it_names_the_variable_that_is_wrong(name, value):
    result = start_with(**{name: value})
    assert result.returncode != 0
    assert name in result.stderr.strip().splitlines()[-1]


def test_it_starts_on_defaults():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DEBUG")}
    result = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
