"""The models this service offers, by public name, as configured in TOKSTREAM_MODELS."""

import functools

from django.conf import settings

from billing import tiktoken_offline

from .engine import loader


def names():
    return sorted(settings.TOKSTREAM_MODELS)


def exists(name):
    return name in settings.TOKSTREAM_MODELS


def folder(name):
    """The transformers folder of the model, or of the local model whose tokenizer it uses."""
    entry = settings.TOKSTREAM_MODELS[name]
    if is_echo(name) or is_upstream(name):
        return folder(entry["tokenizer"])
    return loader.resolve_folder(name, entry, settings.TOKSTREAM_MODEL_CACHE)


def is_upstream(name):
    """Served by an OpenAI-compatible upstream (inference/upstream.py), not by our engine."""
    return settings.TOKSTREAM_MODELS[name]["source"] == "openai-compatible"


def uses_tiktoken(name):
    return is_upstream(name) and settings.TOKSTREAM_MODELS[name]["tokenizer"] in tiktoken_offline.ENCODINGS


def vocabulary_size(name):
    if uses_tiktoken(name):
        return tiktoken_offline.encoding(settings.TOKSTREAM_MODELS[name]["tokenizer"]).n_vocab
    return len(tokenizer(name))


def is_echo(name):
    """The echo model (inference/engine/echo.py) replies with the user's words: for tests and benchmarks."""
    return settings.TOKSTREAM_MODELS[name]["source"] == "echo"


@functools.cache
def tokenizer(name):
    """The web process counts prompt tokens with the very tokenizer the worker uses."""
    return loader.load_tokenizer(folder(name))


@functools.cache
def context_length(name):
    from transformers import AutoConfig

    return loader.context_length_of(AutoConfig.from_pretrained(folder(name), local_files_only=True))


def warm_tokenizers():
    """Load the tokenizers at start-up so the first request does not wait for them."""
    for name in names():
        try:
            if uses_tiktoken(name):
                tiktoken_offline.encoding(settings.TOKSTREAM_MODELS[name]["tokenizer"])
            else:
                tokenizer(name)
        except FileNotFoundError:
            pass  # not prepared yet: the request will get a clear error


def devices():
    return loader.pick_devices(settings.TOKSTREAM_DEVICE)


def load(name, device=None):
    """The model on `device` (by default the first of TOKSTREAM_DEVICE's)."""
    if is_echo(name):
        return loader.load_echo(name, folder(name), settings.TOKSTREAM_MODELS[name].get("step_ms", 0) / 1000)
    return loader.load(name, folder(name), device or devices()[0], settings.TOKSTREAM_DTYPE)
