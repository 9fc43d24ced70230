"""Parse and check a chat completion request body before anything is written or queued."""

import json
import math
import re
from dataclasses import dataclass, field

from inference import backends, registry
from inference.protocol.errors import ApiError, invalid, not_found

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_BEAM_WIDTH = 8
# No chat request needs more; deeper, copying the body (json.dumps, Celery) can run out of stack.
MAX_DEPTH = 64
TOKEN_ID = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit() also takes "²" and "①"
TEXT_RULE = "no NUL character and no lone surrogate (half of a UTF-16 pair)."
MAX_SEED = 2**64  # the engine takes a seed modulo 2**64; a bigger one is a client's mistake
# What beam search cannot honour, with the values that mean "not asked for".
BEAM_SEARCH_EXCLUDES = {
    "stop": [],
    "logprobs": False,
    "logit_bias": {},
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens: int | None = None
    n: int = 1
    tools: list[dict] = field(default_factory=list)  # offered to the model (none with tool_choice "none")
    detach: bool = False  # keep running when the client of the POST leaves, for a later resume
    sampling: dict = field(default_factory=dict)  # the engine's SamplingParams, but max_tokens
    original_messages: list[dict] = field(default_factory=list)  # as the client sent them: what an upstream gets


def parse(body, content_type):
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise invalid("Content-Type must be application/json.")
    data = json_of(body)
    if not isinstance(data, dict):
        raise invalid("The body must be a JSON object.")
    check_values(data)
    if data.get("stream_options") is not None and not data.get("stream"):
        raise invalid("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    chat = ChatRequest(  # keyword arguments run in order: the model is known before its vocabulary is needed
        model=model_of(data),
        messages=messages_of(data),
        stream=boolean(data, "stream", False),
        include_usage=stream_option(data, "include_usage"),
        continuous_usage=stream_option(data, "continuous_usage_stats"),
        max_tokens=max_tokens_of(data),
        n=n_of(data),
        tools=tools_of(data),
        detach=boolean(extension_of(data), "detach_on_disconnect", False, param="tokstream.detach_on_disconnect"),
        sampling=sampling_of(data),
    )
    check_beam_search(chat)
    chat.original_messages = data["messages"]
    return chat


def json_of(body):
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"The body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid(f"The body is nested more than {MAX_DEPTH} levels deep.") from None


def check_values(data):
    """Refuse what JSON can carry but nothing after us can use: NaN and infinities (Python's
    json reads them, and NaN slips through every range check since it compares false), lone
    surrogates (they have no UTF-8: the tokenizer and Redis fail on them), NUL (PostgreSQL's
    text and jsonb cannot hold it) and deep nesting."""
    problem = first_problem(data)
    if problem:
        param, message = problem
        raise invalid(f"`{param}` {message}", param=param)


def first_problem(data):
    """(param, what is wrong) for the first bad value, in document order; None if all is well.
    A loop, not recursion, so depth alone cannot exhaust the stack."""
    pending = [(data, "", 0)]
    while pending:
        value, param, depth = pending.pop()
        problem = value_problem(value, depth)
        if problem:
            return param or "body", problem
        pending.extend(reversed(children(value, param, depth)))
    return None


def value_problem(value, depth):
    if depth > MAX_DEPTH:
        return f"is nested more than {MAX_DEPTH} levels deep."
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number."
    if isinstance(value, str) and not is_text(value):
        return f"is not text this server can take: {TEXT_RULE}"
    if isinstance(value, dict) and not all(is_text(key) for key in value):
        return f"has a key that is not text this server can take: {TEXT_RULE}"
    return None


def children(value, param, depth):
    if isinstance(value, dict):
        return [(item, f"{param}.{key}" if param else key, depth + 1) for key, item in value.items()]
    if isinstance(value, list):
        return [(item, f"{param}.[{i}]", depth + 1) for i, item in enumerate(value)]
    return []


def is_text(text):
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def sampling_of(data):
    """OpenAI's sampling parameters, and vLLM's top_k, min_p and repetition_penalty."""
    return {
        "temperature": number(data, "temperature", 1.0, 0.0, 2.0),
        "top_p": number(data, "top_p", 1.0, 0.0, 1.0, low_open=True),
        "top_k": top_k_of(data),
        "min_p": number(data, "min_p", 0.0, 0.0, 1.0),
        "presence_penalty": number(data, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": number(data, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": number(data, "repetition_penalty", 1.0, 0.0, 2.0, low_open=True),
        "logit_bias": logit_bias_of(data),
        "seed": seed_of(data),
        "stop": stop_of(data),
        **logprobs_of(data),
        "beam_width": beam_width_of(data),
    }


def extension_of(data):
    """Our own options, under `tokstream` so that no OpenAI parameter is shadowed."""
    options = present(data, "tokstream", {})
    if not isinstance(options, dict):
        raise invalid("`tokstream` must be an object.", param="tokstream")
    unknown = sorted(set(options) - {"beam_width", "detach_on_disconnect"})
    if unknown:
        raise invalid(f"`tokstream.{unknown[0]}` is not an option of this server.", param=f"tokstream.{unknown[0]}")
    return options


def beam_width_of(data):
    width = extension_of(data).get("beam_width", 1)
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_BEAM_WIDTH:
        raise invalid(f"`tokstream.beam_width` must be an integer in [1, {MAX_BEAM_WIDTH}]; got {width!r}.", param="tokstream.beam_width")
    return width


def check_beam_search(chat):
    """Beam search is deterministic and keeps whole sequences: say what it cannot do rather
    than drop it silently. (temperature, top_p, top_k, min_p and seed do not apply to it.)"""
    if chat.sampling["beam_width"] == 1:
        return
    if chat.n != 1:
        raise invalid("`n` cannot be combined with `tokstream.beam_width`.", param="n")
    for name, neutral in BEAM_SEARCH_EXCLUDES.items():
        if chat.sampling[name] != neutral:
            raise invalid(f"`{name}` cannot be combined with `tokstream.beam_width`.", param=name)


def logprobs_of(data):
    wanted = boolean(data, "logprobs", False)
    top = integer(data, "top_logprobs", None)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"`top_logprobs` must be in [0, {MAX_TOP_LOGPROBS}]; got {top}.", param="top_logprobs")
    if top and not wanted:
        raise invalid("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
    return {"logprobs": wanted, "top_logprobs": top or 0}


def seed_of(data):
    seed = integer(data, "seed", None)
    if seed is not None and not -MAX_SEED < seed < MAX_SEED:
        raise invalid("`seed` must be within a 64-bit integer's range.", param="seed")
    return seed


def top_k_of(data):
    value = integer(data, "top_k", 0)
    if value is not None and value < -1:
        raise invalid(f"`top_k` must be -1 or 0 (off), or at least 1; got {value}.", param="top_k")
    return max(value or 0, 0)


def logit_bias_of(data):
    bias = present(data, "logit_bias", {})
    if not isinstance(bias, dict):
        raise invalid("`logit_bias` must map token ids to numbers.", param="logit_bias")
    vocabulary = backends.of(data["model"]).vocabulary_size() if bias else 0
    checked = {}
    for token, value in bias.items():
        if not TOKEN_ID.fullmatch(token) or int(token) >= vocabulary:
            raise invalid(f"`logit_bias` has {token!r}, which is not a token id of this model.", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise invalid(f"`logit_bias` values must be numbers in [-100, 100]; got {value!r}.", param="logit_bias")
        checked[int(token)] = float(value)
    return checked


def model_of(data):
    name = data.get("model")
    if not isinstance(name, str) or not name:
        raise invalid("`model` is required and must be a string.", param="model")
    if not registry.exists(name):
        raise not_found(f"The model `{name}` does not exist.", code="model_not_found", param="model")
    return name


def messages_of(data):
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("`messages` must be a non-empty array.", param="messages")
    return [message_of(m, i) for i, m in enumerate(messages)]


def message_of(message, index):
    param = f"messages.[{index}]"
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or role not in ROLES:  # a list or an object is unhashable
        raise invalid(f"{param}.role must be one of {', '.join(sorted(ROLES))}.", param=f"{param}.role")
    role = "system" if role == "developer" else role
    checked = {"role": role, "content": content_text(message.get("content"), f"{param}.content")}
    if role == "assistant" and message.get("tool_calls") is not None:
        checked["tool_calls"] = earlier_calls(message["tool_calls"], f"{param}.tool_calls")
    return checked


def earlier_calls(calls, param):
    """An assistant turn's calls, as the model wrote them: {"name", "arguments"}."""
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
        raise invalid(f"{param} must be a list of function calls.", param=param)
    return [{"name": str(c["function"].get("name", "")), "arguments": arguments_of(c["function"].get("arguments"))} for c in calls]


def arguments_of(text):
    """Arguments that parse (sanely) as JSON are shown to the model as JSON; others as written."""
    try:
        arguments = json.loads(text) if isinstance(text, str) else text
    except (ValueError, RecursionError):
        return text
    return text if first_problem(arguments) else arguments


def tools_of(data):
    tools = present(data, "tools", [])
    if not isinstance(tools, list) or not all(is_function_tool(t) for t in tools):
        raise invalid('`tools` must be a list of {"type": "function", "function": {"name", "description", "parameters"}}.', param="tools")
    choice = present(data, "tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise invalid('Only `tool_choice` "auto" and "none" are supported.', param="tool_choice")
    return tools if choice == "auto" else []


def is_function_tool(tool):
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return False
    function = tool["function"]
    name = function.get("name")
    return (
        tool.get("type") == "function"
        and isinstance(name, str)
        and FUNCTION_NAME.fullmatch(name) is not None  # match() with $ let a trailing newline in
        and isinstance(function.get("parameters", {}), dict)
        and isinstance(function.get("description"), (str, type(None)))
    )


def content_text(content, param):
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(is_text_part(p) for p in content):
        return "".join(p["text"] for p in content)
    if content is None:
        return ""
    raise invalid(f"{param} must be a string or an array of text parts.", param=param)


def is_text_part(part):
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def n_of(data):
    value = integer(data, "n", 1)
    if value is None:
        return 1
    if not 1 <= value <= MAX_CHOICES:
        raise invalid(f"`n` must be in [1, {MAX_CHOICES}]; got {value}.", param="n")
    return value


def present(data, name, default):
    """data[name], or `default` when it is missing or null; not `data.get(name) or default`,
    which took a wrong type that happens to be falsy (0, "", [], false) for "not given"."""
    value = data.get(name)
    return default if value is None else value


def boolean(data, name, default, param=None):
    value = data.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"`{param or name}` must be a boolean.", param=param or name)
    return value


def stream_option(data, name):
    options = present(data, "stream_options", {})
    if not isinstance(options, dict):
        raise invalid("`stream_options` must be an object.", param="stream_options")
    return boolean(options, name, False)


def number(data, name, default, low, high, low_open=False):
    value = data.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"`{name}` must be a number.", param=name)
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise invalid(f"`{name}` must be in {bounds}; got {value}.", param=name)
    return float(value)


def integer(data, name, default):
    value = data.get(name, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise invalid(f"`{name}` must be an integer.", param=name)
    return value


def max_tokens_of(data):
    name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    value = integer(data, name, None)
    if value is not None and value < 1:
        raise invalid(f"`{name}` must be at least 1; got {value}.", param=name)
    return value


def stop_of(data):
    stop = data.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise invalid(f"`stop` must be a non-empty string or up to {MAX_STOP} of them.", param="stop")
    return stop


def checked_max_tokens(chat, prompt_tokens, context_length, default):
    """The completion budget, or the error OpenAI gives when prompt + budget cannot fit in the
    context (the model's, or the worker's KV cache if smaller)."""
    room = context_length - prompt_tokens
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {context_length} tokens; the messages use "
            f"{prompt_tokens}. Please shorten them.",
            param="messages",
            code="context_length_exceeded",
        )
    if chat.max_tokens is None:
        return min(room, default)
    if chat.max_tokens > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {context_length} tokens; you asked for "
            f"{prompt_tokens} in the messages and {chat.max_tokens} in the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return chat.max_tokens
