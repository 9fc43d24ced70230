"""How each model is served, as the gateway (to admit and count) and the worker (to run) ask it.

`of(name)` is the one place that tells the three kinds apart:
- `LocalBackend`: our engine runs the model on every device the worker has;
- `EchoBackend`: the echo model (engine/echo.py), a local model for tests and benchmarks;
- `UpstreamBackend`: an OpenAI-compatible upstream generates, the worker relays its stream
  (worker/relay.py), and we count its tokens as the vendor bills them.

An upstream's registry entry: {"source": "openai-compatible", "base_url": ".../v1",
"api_key_env": NAME, "upstream_model": NAME, "tokenizer": T, "context_length": N, "server": S,
"max_concurrent": M}, where T is a tiktoken encoding (`o200k_base`, `cl100k_base`) or the name of
a registered local model whose tokenizer and chat template the upstream uses, S the kind of
server (`vllm`, `sglang`, `llama.cpp`, `llama-cpp-python`, `openai`: how its usage counts a reply's end, see
inference/upstream.py) and M how many requests it is sent at once (the rest wait here).
"""

import functools
import json

from django.conf import settings

from inference import counting, registry, tiktoken_offline, upstream
from inference.protocol import tools
from inference.protocol.errors import ApiError, invalid

KV_BLOCK_SIZE = 16  # tokens a KV-cache block holds: the engine's BLOCK_SIZE (tests/test_kv_cache.py checks)
DEFAULT_CONTEXT = 131072
# What a relayed request may carry; everything else our parser accepts is refused, by name.
NOT_RELAYED = {"n": 1, "beam_width": 1, "logprobs": False}


@functools.cache
def of(name):
    kinds = {"echo": EchoBackend, "openai-compatible": UpstreamBackend}
    return kinds.get(registry.source(name), LocalBackend)(name)


class Catalog:
    """The models a request may name, as the request schema asks of them."""

    def exists(self, name):
        return registry.exists(name)

    def vocabulary_size(self, name):
        return of(name).vocabulary_size()


CATALOG = Catalog()


def warm_tokenizers():
    """Load the tokenizers at start-up so the first request does not wait for them."""
    for name in registry.names():
        try:
            of(name).warm()
        except FileNotFoundError:
            pass  # not prepared yet: the request will get a clear error


class LocalBackend:
    engine = "weights"  # the worker loads the model's weights, one engine on each of its devices
    steerable = True

    def __init__(self, name):
        self.name = name

    def check(self, chat):
        """Refuse what this backend cannot do, before anything is counted or written."""
        if chat.forced_tool:  # our engine cannot make a model call a tool; an upstream can
            raise invalid(
                '`tool_choice` "required" or a named function is supported for upstream models only; local models take "auto" or "none".', param="tool_choice"
            )

    def prompt(self, chat):
        """(the ids the model will read, or None where it is not ours to read; the prompt
        tokens billed)."""
        try:
            tokenizer = registry.tokenizer(self.name)
        except FileNotFoundError as exc:
            raise ApiError(503, f"The model `{self.name}` is not available: {exc}", type="server_error") from None
        turns = tools.render(chat.messages, chat.tools)
        ids = list(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True))
        return ids, len(ids)

    def room(self, chat):
        """A sequence never holds more than the worker's whole KV cache, whatever the model
        allows; beams must all fit at once."""
        cache_tokens = registry.kv_cache_tokens(self.name) // KV_BLOCK_SIZE * KV_BLOCK_SIZE  # as the pool rounds
        return min(registry.context_length(self.name), cache_tokens // chat.sampling.beam_width)

    def tokenizer_id(self):
        return registry.tokenizer_identity(self.name)

    def vocabulary_size(self):
        return len(registry.tokenizer(self.name))

    def upstream_body(self, chat, max_tokens):
        return None

    def warm(self):
        registry.tokenizer(self.name)


class EchoBackend(LocalBackend):
    engine = "echo"  # an engine that computes nothing: one, on the CPU


class UpstreamBackend(LocalBackend):
    engine = None  # no engine: the worker relays the upstream's stream
    steerable = False

    def __init__(self, name):
        super().__init__(name)
        self.entry = registry.entry(name)
        self.tokenizer_name = self.entry["tokenizer"]
        self.tiktoken = self.tokenizer_name in tiktoken_offline.ENCODINGS
        self.end_of_turn_counted = upstream.counts_end_of_turn(self.entry)
        self.stop_string_counted = upstream.counts_stop_string(self.entry)
        self.max_concurrent = upstream.max_concurrent(self.entry, settings.TOKSTREAM_MODELS.values())
        self.slots = upstream.slots_of(self.entry)

    @property
    def served_model(self):
        return self.entry["upstream_model"]

    def check(self, chat):
        for name, default in NOT_RELAYED.items():
            value = chat.n if name == "n" else getattr(chat.sampling, name, default)
            if value != default:
                raise invalid(f"`{name}` is not supported for the upstream model `{chat.model}`.", param=name)
        upstream.refuse_unforwarded(chat.sent)
        upstream.messages(chat.sent["messages"])  # refuses what cannot be forwarded, by name

    def prompt(self, chat):
        """Prompt tokens as the upstream reads them: OpenAI's message framing and tool overhead
        for a tiktoken family, else the local model's own chat template given the messages and
        tools as an OpenAI-compatible server gives them (as vLLM does)."""
        if self.tiktoken:
            try:
                return None, counting.chat_prompt_tokens([plain(m) for m in chat.sent["messages"]], self.tokenizer_name, chat.tools)
            except tiktoken_offline.EncodingUnavailable as exc:
                raise ApiError(503, f"The tokenizer of `{chat.model}` is not available: {exc}", type="server_error") from None
        turns = upstream.template_messages(chat.sent["messages"])
        template = registry.tokenizer(self.tokenizer_name).apply_chat_template
        return None, len(template(turns, tools=chat.tools or None, add_generation_prompt=True, tokenize=True))

    def count_text(self, text):
        if self.tiktoken:
            return counting.text_tokens(text, self.tokenizer_name)
        return len(registry.tokenizer(self.tokenizer_name).encode(text, add_special_tokens=False))

    def count_completion(self, text, finish_reason, stop=(), stop_reason=upstream.UNSAID):
        """Our count of a relayed reply (see upstream.completion_estimate)."""
        return upstream.completion_estimate(self.count_text, text, finish_reason, stop, self.end_of_turn_counted, stop_reason, self.stop_string_counted)

    def room(self, chat):
        return int(self.entry.get("context_length", DEFAULT_CONTEXT))

    def tokenizer_id(self):
        return self.tokenizer_name if self.tiktoken else f"{self.name}:{self.tokenizer_name}"

    def vocabulary_size(self):
        if self.tiktoken:
            return tiktoken_offline.encoding(self.tokenizer_name).n_vocab
        return len(registry.tokenizer(self.tokenizer_name))

    def upstream_body(self, chat, max_tokens):
        return upstream.body(chat.sent, self.served_model)

    def warm(self):
        if self.tiktoken:
            tiktoken_offline.encoding(self.tokenizer_name)
        else:
            registry.tokenizer(self.tokenizer_name)


def plain(message):
    """A message as text fields only (what the counting rules count)."""
    return {key: value if isinstance(value, str) else json.dumps(value) for key, value in message.items() if value is not None}
