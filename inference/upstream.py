"""What an OpenAI-compatible upstream is sent, and how its usage is read and cross-checked.

Forwarding is faithful: the upstream gets the fields its client sent (and `stream_options`,
to ask for the usage), never a default of ours that would override its own. Messages go in the
OpenAI shape every compatible server reads; what cannot be forwarded is refused, by name.

Billing: when the upstream reports usage, that is what its invoice will say, so it is the bill,
and our count stands beside it as the cross-check. When it reports none, our count is billed as
an estimate and nothing was compared.
"""

import json

from inference.protocol.entries import FinishReason
from inference.protocol.errors import invalid

# The body fields an upstream is forwarded when the client sent them: OpenAI's, and the sampling
# extensions vLLM and llama.cpp share. `n` and `logprobs` only ever at their neutral values
# (anything else is refused before); our own `tokstream` options stay here.
FORWARDED = (
    "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "logit_bias",
    "logprobs", "tools", "tool_choice", "user",
)  # fmt: skip

# Whether a known server's usage counts the end-of-turn token a reply ends with when the model
# stops by itself: vLLM, SGLang and llama.cpp's own llama-server count every id the model
# produced (llama-server measured: tests/test_upstream_llama_cpp.py); llama-cpp-python's server
# stops before it; OpenAI's usage counts the text. A registry entry's "server" picks one, and
# "counts_end_of_turn" overrides it.
COUNTS_END_OF_TURN = {"vllm": True, "sglang": True, "llama.cpp": True, "llama-cpp-python": False, "openai": False}
DEFAULT_MAX_CONCURRENT = 8  # requests in flight to one upstream; set it to the server's slots

# How an entry's counts were obtained (UsageEntry.usage_source).
FROM_UPSTREAM = "upstream"  # the upstream's usage: the bill; ours beside it
ESTIMATED = "estimate"  # the upstream reported none: our count, billed as an estimate


def server_of(entry, tiktoken):
    return entry.get("server") or ("openai" if tiktoken else "vllm")


def counts_end_of_turn(entry, tiktoken):
    if "counts_end_of_turn" in entry:
        return bool(entry["counts_end_of_turn"])
    return COUNTS_END_OF_TURN.get(server_of(entry, tiktoken), False)


def max_concurrent(entry):
    return int(entry.get("max_concurrent", DEFAULT_MAX_CONCURRENT))


# -- forwarding -------------------------------------------------------------------------------


def body(sent, served_model):
    """The upstream's request: what the client sent, in the upstream's model name, always
    streamed, with the usage asked for."""
    forwarded = {name: sent[name] for name in FORWARDED if sent.get(name) is not None}
    forwarded["messages"] = messages(sent["messages"])
    return {**forwarded, "model": served_model, "stream": True, "stream_options": {"include_usage": True}}


def messages(sent):
    return [message(m, i) for i, m in enumerate(sent)]


def message(sent, index):
    """One message as OpenAI's schema has it. A tool-call turn's content goes as "" rather than
    null (chat templates that join content and calls fail on null), each call with its id and its
    arguments as JSON text; a tool result names the call it answers."""
    forwarded = {key: value for key, value in sent.items() if value is not None}
    if sent.get("tool_calls"):
        forwarded["content"] = sent.get("content") or ""
        forwarded["tool_calls"] = [call(c, f"messages.[{index}].tool_calls.[{j}]") for j, c in enumerate(sent["tool_calls"])]
    if sent["role"] == "tool" and not isinstance(sent.get("tool_call_id"), str):
        raise not_forwardable(f"messages.[{index}].tool_call_id", "a tool result must name the call it answers")
    return forwarded


def call(sent, param):
    if not isinstance(sent.get("id"), str) or not sent["id"]:
        raise not_forwardable(f"{param}.id", "a call needs its id, which its tool result names")
    function = sent["function"]
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps({} if arguments is None else arguments)
    return {"id": sent["id"], "type": "function", "function": {"name": function.get("name", ""), "arguments": arguments}}


def not_forwardable(param, why):
    return invalid(f"`{param}` is required for an upstream model: {why}.", param=param)


def template_messages(sent):
    """The messages as an OpenAI-compatible server hands them to a chat template (as vLLM
    does): text parts joined, a call's arguments as an object where they parse."""
    turns = []
    for forwarded in messages(sent):
        turn = {**forwarded, "content": text_of(forwarded.get("content"))}
        if "tool_calls" in turn:
            turn["tool_calls"] = [{**c, "function": {**c["function"], "arguments": parsed(c["function"]["arguments"])}} for c in turn["tool_calls"]]
        turns.append(turn)
    return turns


def text_of(content):
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def parsed(arguments):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


# -- counting ---------------------------------------------------------------------------------


def completion_estimate(count, text, finish_reason, stop, end_of_turn_counted):
    """Our count of a reply from its text, `count` being the upstream's tokenizer. A reply cut
    at a stop string produced the stop string's tokens too, though none of it is shown: when
    stop strings were given and the reply stopped, the cut is assumed (the stream does not say
    which ended it), at the stop string that adds the fewest tokens."""
    if finish_reason == FinishReason.STOP and stop:
        return min(count(text + s) for s in stop)
    return count(text) + (end_of_turn_counted and finish_reason == FinishReason.STOP)


def vendor_counts(usage):
    """(prompt, cached prompt, completion) from an upstream's usage object; None without one."""
    if not usage or usage.get("prompt_tokens") is None or usage.get("completion_tokens") is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage["prompt_tokens"]), int(cached), int(usage["completion_tokens"])
