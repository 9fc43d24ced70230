"""What an OpenAI-compatible upstream is sent, and how its usage is read and cross-checked.

Forwarding is faithful: the upstream gets the fields its client sent (and `stream_options`,
to ask for the usage), never a default of ours that would override its own. Messages go in the
OpenAI shape every compatible server reads; what cannot be forwarded is refused, by name.

Billing: when the upstream reports usage, that is what its invoice will say, so it is the bill,
and our count stands beside it as the cross-check. When it reports none, our count is billed as
an estimate and nothing was compared.
"""

import json
from dataclasses import dataclass

from django.core.exceptions import ImproperlyConfigured

from inference.protocol.entries import FinishReason
from inference.protocol.errors import invalid
from inference.tiktoken_offline import ENCODINGS

# What the relay answers for itself rather than forwarding as sent: the model (the upstream's
# name for it), the stream (always one) and its options (the usage always asked for), and our
# own extension.
OURS = ("model", "stream", "stream_options", "tokstream")
# The fields an upstream is forwarded, as the client sent them: OpenAI's chat parameters whose
# answers a relay of text and tool-call chunks passes on, and the sampling extensions vLLM and
# llama.cpp share. Anything else is refused by name: passed on unread, a field could change what
# the vendor bills (a priority tier, beam search) or what it counts (the stop string kept in the
# output), or ask for an answer the relay would lose (audio, old-style function calls).
FORWARDED = (
    "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "logit_bias",
    "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "user", "metadata", "store", "reasoning_effort",
)  # fmt: skip

# Whether a known server's usage counts the end-of-turn token a reply ends with when the model
# stops by itself: vLLM, SGLang and llama.cpp's own llama-server count every id the model
# produced (llama-server measured: tests/test_upstream_llama_cpp.py); llama-cpp-python's server
# stops before it; OpenAI's usage counts the text. A registry entry's "server" picks one, and
# "counts_end_of_turn" overrides it.
COUNTS_END_OF_TURN = {"vllm": True, "sglang": True, "llama.cpp": True, "llama-cpp-python": False, "openai": False}
# Whether a known server's usage counts the tokens of the stop string that cut a reply: vLLM,
# SGLang and llama-server count every id the model produced, the stop string's too (llama-server
# measured: tests/test_upstream_llama_cpp.py); llama-cpp-python's server counts the reply's text
# without it (a reply cut at "," billed 28 tokens there, its text and the stop string are 29).
# "counts_stop_string" in an entry overrides it.
COUNTS_STOP_STRING = {"vllm": True, "sglang": True, "llama.cpp": True, "llama-cpp-python": False, "openai": True}
# Requests in flight to one server unless its entry says "max_concurrent": llama-cpp-python's
# server interrupts the request it runs when another arrives, so it gets one at a time; the
# others queue what they cannot run yet themselves.
MAX_CONCURRENT = {"llama-cpp-python": 1}
DEFAULT_MAX_CONCURRENT = 8

# How an entry's counts were obtained (UsageEntry.usage_source).
FROM_UPSTREAM = "upstream"  # the upstream's usage: the bill; ours beside it
ESTIMATED = "estimate"  # the upstream reported none: our count, billed as an estimate


def server_of(entry):
    server = entry.get("server") or ("openai" if entry["tokenizer"] in ENCODINGS else "vllm")
    if server not in COUNTS_END_OF_TURN:
        raise ImproperlyConfigured(f"TOKSTREAM_MODELS: server {server!r} is not one of {', '.join(COUNTS_END_OF_TURN)}")
    return server


def counts_end_of_turn(entry):
    if "counts_end_of_turn" in entry:
        return bool(entry["counts_end_of_turn"])
    return COUNTS_END_OF_TURN[server_of(entry)]


def counts_stop_string(entry):
    if "counts_stop_string" in entry:
        return bool(entry["counts_stop_string"])
    return COUNTS_STOP_STRING[server_of(entry)]


def max_concurrent(entry, entries):
    """How many requests the entry's slots admit at once. Entries that share slots (see
    slots_of), so the least any of them allows holds for all."""
    return min(own_limit(other) for other in entries if other.get("source") == "openai-compatible" and slots_of(other) == slots_of(entry))


def slots_of(entry):
    """What a limit counts the requests of: a self-hosted server's slots are shared by every
    model it serves; a vendor's API limits each model apart."""
    url = entry["base_url"].rstrip("/")
    return f"{url}|{entry['upstream_model']}" if server_of(entry) == "openai" else url


def own_limit(entry):
    limit = entry.get("max_concurrent", MAX_CONCURRENT.get(server_of(entry), DEFAULT_MAX_CONCURRENT))
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ImproperlyConfigured(f"TOKSTREAM_MODELS: max_concurrent must be a positive integer, not {limit!r}")
    return limit


# -- forwarding -------------------------------------------------------------------------------


def body(sent, served_model):
    """The upstream's request: what the client sent, in the upstream's model name, always
    streamed, with the usage asked for. A field sent as null is a field not sent."""
    forwarded = {name: sent[name] for name in FORWARDED if sent.get(name) is not None}
    forwarded["messages"] = messages(sent["messages"])
    return {**forwarded, "model": served_model, "stream": True, "stream_options": {"include_usage": True}}


def refuse_unforwarded(sent):
    """Nothing the client sent is dropped unsaid: a field that is not forwarded is refused."""
    for name in sorted(set(sent) - set(FORWARDED) - set(OURS)):
        if sent[name] is not None:
            raise invalid(f"`{name}` is not supported for an upstream model: it is not forwarded.", param=name)


def messages(sent):
    return [message(m, i) for i, m in enumerate(sent)]


def message(sent, index):
    """One message as OpenAI's schema has it. Content goes as "" rather than null (chat
    templates that join content and calls fail on null, and a turn without content is refused),
    a call turn with its calls, each with its id and its arguments as JSON text (an empty list
    of calls is no call turn); a tool result names the call it answers."""
    forwarded = {key: value for key, value in sent.items() if value is not None and key != "tool_calls"}
    forwarded["content"] = sent.get("content") or ""
    if sent.get("tool_calls"):
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


UNSAID = object()  # the upstream did not say why it stopped


def completion_estimate(count, text, finish_reason, stop, end_of_turn_counted, stop_reason=UNSAID, stop_string_counted=True):
    """Our count of a reply from its text, `count` being the upstream's tokenizer. A reply cut
    at a stop string produced the stop string's tokens too, though none of it is shown, and a
    server that bills them (`stop_string_counted`) counts them. vLLM says which ended it
    (`stop_reason`: the stop string, or a token id or null for the end of the turn); where the
    upstream does not say and stop strings were given, the cut is assumed, at the stop string
    that adds the fewest tokens."""
    if finish_reason == FinishReason.STOP and stop and stop_string_counted:
        if isinstance(stop_reason, str) and stop_reason in stop:
            return count(text + stop_reason)
        if stop_reason is UNSAID:
            return min(count(text + s) for s in stop)
    return count(text) + (end_of_turn_counted and finish_reason == FinishReason.STOP)


@dataclass(frozen=True)
class VendorUsage:
    """The token counts an upstream reported for one request."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int


def vendor_usage(usage):
    """The counts in an upstream's usage object, read where it arrives; None without one, or
    with counts that are not counts (nothing is billed from a malformed report)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = (details.get("cached_tokens") if isinstance(details, dict) else None) or 0
    counts = (usage.get("prompt_tokens"), cached, usage.get("completion_tokens"))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None
    return VendorUsage(*counts)
