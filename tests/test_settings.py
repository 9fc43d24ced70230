"""The settings are declared once (tokstream_site/config.py): the README's table is theirs, the
code reads no variable they do not declare, and a bad value or combination stops start-up
naming what is wrong."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from tokstream_site import config

ROOT = Path(__file__).resolve().parent.parent
CODE = [*ROOT.glob("inference/**/*.py"), *ROOT.glob("billing/**/*.py"), *ROOT.glob("tokstream_site/*.py")]


def test_the_readme_table_is_the_declared_settings():
    readme = (ROOT / "README.md").read_text()
    assert config.with_table(readme) == readme, "README.md's settings table is stale: run `python -m tokstream_site.config --write README.md`"


def test_every_setting_the_code_reads_is_declared_and_every_declared_one_is_read():
    read = {name for file in CODE for name in re.findall(r"settings\.(TOKSTREAM_[A-Z_]+)", file.read_text())}
    declared = set(config.read({}).tokstream())
    assert read - declared == set(), "read but not declared"
    # The cache folders are read through CACHE_DIR and the model cache's own helpers.
    assert declared - read - {"TOKSTREAM_CACHE_DIR"} == set(), "declared but never read"


def test_the_defaults_are_the_shipped_ones():
    values = config.read({}).values()
    assert values["TOKSTREAM_KEEPALIVE_SECONDS"] == 15 and values["TOKSTREAM_ABANDON_SECONDS"] == 10
    assert values["TOKSTREAM_MODEL_CACHE"] == values["TOKSTREAM_CACHE_DIR"] / "models"
    assert config.read({"TOKSTREAM_CACHE_DIR": "/srv/ts"}).models.model_cache == Path("/srv/ts/models")
    assert config.read({"TOKSTREAM_DEVICE": "cpu"}).engine.max_running == 32  # a GPU's default needs a GPU to run on


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"TOKSTREAM_MAX_RUNNING": "lots"}, "TOKSTREAM_MAX_RUNNING='lots' is not an integer"),
        ({"TOKSTREAM_MAX_RUNNING": "0"}, "TOKSTREAM_MAX_RUNNING='0' must be at least 1"),
        ({"TOKSTREAM_DTYPE": "float8"}, "TOKSTREAM_DTYPE='float8' must be one of auto, float32"),
        ({"LOG_LEVEL": "LOUD"}, "LOG_LEVEL='LOUD' must be one of DEBUG"),
        ({"TOKSTREAM_DEVICE": "cuda:0,,cuda:1"}, "TOKSTREAM_DEVICE='cuda:0,,cuda:1' must be auto"),
        ({"TOKSTREAM_MODELS": "{not json"}, "TOKSTREAM_MODELS='{not json' is not valid JSON"),
        ({"TOKSTREAM_MODELS": '{"m": "/models/m"}'}, 'TOKSTREAM_MODELS must map names to {"source": "..."} objects'),
        ({"TOKSTREAM_WORKER_TTL": "1"}, "TOKSTREAM_WORKER_TTL='1' must be at least 2"),
        ({"DEBUG": "maybe"}, "DEBUG='maybe' is not a boolean"),
        ({"TOKSTREAM_WEIGHTS": "int3"}, "TOKSTREAM_WEIGHTS='int3' must be one of auto, float32"),
        ({"REDIS_URL": "http://x"}, "REDIS_URL='http://x' must start with redis://"),
        ({"TOKSTREAM_DEVICE": "gpu"}, "TOKSTREAM_DEVICE='gpu' must be auto, or cpu"),
        ({"TOKSTREAM_MODELS": "[1]"}, "TOKSTREAM_MODELS='[1]' must be a JSON object"),
        ({"TOKSTREAM_MODELS": '{"e": {"source": "echo"}}'}, "the echo model 'e' needs \"tokenizer\""),
        ({"TOKSTREAM_LOG_MAXLEN": "1000"}, "TOKSTREAM_LOG_MAXLEN=1000 must be above TOKSTREAM_DEFAULT_MAX_TOKENS=1024"),
        ({"TOKSTREAM_DEFAULT_MAX_TOKENS": "50000"}, "TOKSTREAM_LOG_MAXLEN=20000 must be above TOKSTREAM_DEFAULT_MAX_TOKENS=50000"),
    ],
)
def test_a_bad_value_or_combination_names_what_is_wrong(environ, message):
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        config.read(environ)


def check(**env):
    """`manage.py check` as the service starts: the test settings' environment left out."""
    environ = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "DEBUG", "DJANGO_SETTINGS_MODULE")}
    return subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=120)


def test_it_starts_on_defaults():
    result = check()
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TOKSTREAM_LOG_MAXLEN": "500", "TOKSTREAM_DEFAULT_MAX_TOKENS": "600"}, "TOKSTREAM_LOG_MAXLEN=500 must be above TOKSTREAM_DEFAULT_MAX_TOKENS=600"),
        ({"DATABASE_URL": "not-a-url"}, "DATABASE_URL='not-a-url' is not a database URL"),
        ({"TOKSTREAM_MAX_RUNNING": "lots"}, "TOKSTREAM_MAX_RUNNING='lots' is not an integer"),
    ],
)
def test_the_service_does_not_start_on_a_bad_setting(env, message):
    result = check(**env)
    assert result.returncode != 0
    assert message in result.stderr.strip().splitlines()[-1]
