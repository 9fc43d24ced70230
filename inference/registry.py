"""The models this service offers, by public name, as configured in TOKSTREAM_MODELS, and the
files each one reads (how each is served: inference/backends.py)."""

import functools

from django.conf import settings

from inference import model_files


def names():
    return sorted(settings.TOKSTREAM_MODELS)


def exists(name):
    return name in settings.TOKSTREAM_MODELS


def entry(name):
    return settings.TOKSTREAM_MODELS[name]


def source(name):
    return entry(name)["source"]


def folder(name):
    """The transformers folder of the model, or of the local model whose tokenizer it names
    (the echo model and upstreams read a local model's tokenizer)."""
    borrowed = entry(name).get("tokenizer")
    if borrowed != name and borrowed in settings.TOKSTREAM_MODELS:
        return folder(borrowed)
    return model_files.resolve_folder(name, entry(name), settings.TOKSTREAM_MODEL_CACHE)


@functools.cache
def tokenizer(name):
    """The web process counts prompt tokens with the very tokenizer the worker uses."""
    return model_files.load_tokenizer(folder(name))


@functools.cache
def config(name):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder(name), local_files_only=True)


def context_length(name):
    return model_files.context_length_of(config(name))


def kv_cache_tokens(name):
    """Tokens the worker's KV cache holds for this model, as the worker sizes it (its dtype
    depends on the model's only where the model computes in float16: 2 bytes either way)."""
    kv_dtype = model_files.kv_dtype(settings.TOKSTREAM_KV_DTYPE, settings.TOKSTREAM_WEIGHTS, "bfloat16")
    return model_files.kv_cache_tokens(config(name), settings.TOKSTREAM_KV_CACHE_MB, kv_dtype)


@functools.cache
def tokenizer_identity(name):
    """As the ledger names the tokenizer (hashing its files once per process)."""
    return f"{name}:{model_files.tokenizer_identity(folder(name))}"
