"""The models this service offers, by public name, as configured in TOKSTREAM_MODELS."""

import functools

from django.conf import settings

from .engine import loader


def names():
    return sorted(settings.TOKSTREAM_MODELS)


def exists(name):
    return name in settings.TOKSTREAM_MODELS


def folder(name):
    return loader.resolve_folder(name, settings.TOKSTREAM_MODELS[name], settings.TOKSTREAM_MODEL_CACHE)


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
            tokenizer(name)
        except FileNotFoundError:
            pass  # not prepared yet: the request will get a clear error


def devices():
    return loader.pick_devices(settings.TOKSTREAM_DEVICE)


def load(name, device=None):
    """The model on `device` (by default the first of TOKSTREAM_DEVICE's)."""
    return loader.load(name, folder(name), device or devices()[0], settings.TOKSTREAM_DTYPE)
