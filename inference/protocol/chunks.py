"""Turn log entries (inference.protocol.entries) into OpenAI chat.completion.chunk objects and SSE frames."""

import json
import re

from inference.protocol.entries import (
    TOOL_KINDS,
    Accepted,
    Delta,
    Line,
    Open,
    Steer,
    ToolArgs,
    ToolStart,
    usage_of,
)
from inference.protocol.errors import ApiError


class ChunkWriter:
    """Every chunk of one request carries the same id and created (as OpenAI's do)."""

    def __init__(self, admitted, include_usage=False, continuous_usage=False, resumed=False, places=False):
        self.base = {
            "id": admitted.request_id,
            "object": "chat.completion.chunk",
            "created": admitted.created,
            "model": admitted.model,
        }
        self.admitted = admitted
        self.prompt_tokens = admitted.prompt_tokens
        self.produced = {}  # choice -> completion tokens so far, for a stream cut short
        self.interrupted = False
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.resumed = resumed  # a resumed reader has seen the role already
        self.places = places  # the chat page's: it shows where a request stands in line
        self.roles_sent = set()

    def chunks(self, entry):
        if isinstance(entry, Open):
            return [self.open_chunk(entry)]
        if isinstance(entry, Delta):
            return [self.delta_chunk(entry)]
        if isinstance(entry, Steer):
            return [self.steer_chunk(entry)]
        if isinstance(entry, TOOL_KINDS):
            return [self.tool_chunk(entry)]
        if isinstance(entry, Accepted):
            return []
        if isinstance(entry, Line):
            return [self.line_chunk(entry)] if self.places else []
        return self.end_chunks(entry)

    def opening(self, index):
        """The role, in the first delta of each choice."""
        if self.resumed or index in self.roles_sent:
            return {}
        self.roles_sent.add(index)
        return {"role": "assistant"}

    def open_chunk(self, entry):
        """The role of every choice, with our extension: the request's place in the queue."""
        choices = [{"index": i, "delta": {**self.opening(i), "content": ""}, "logprobs": None, "finish_reason": None} for i in range(entry.choices)]
        chunk = {**self.chunk(choices), "tokstream": {"queue_position": entry.queue_position}}
        if self.continuous_usage:
            chunk["usage"] = usage_of(self.prompt_tokens, 0)
        return chunk

    def line_chunk(self, entry):
        """Our extension, for the chat page: before the first token, the requests in line before
        this one, or that its prompt is being read. No choices, as a usage chunk."""
        place = {"queue_position": entry.ahead} if entry.ahead is not None else {"reading_prompt": True}
        return {**self.chunk([]), "tokstream": place}

    def delta_chunk(self, entry):
        index = entry.i
        self.produced[index] = entry.completion_tokens
        delta = {**self.opening(index), "content": entry.text}
        logprobs = {"content": entry.logprobs} if entry.logprobs is not None else None
        chunk = self.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}])
        if self.continuous_usage:  # as vLLM's continuous_usage_stats: the usage so far
            chunk["usage"] = usage_of(self.prompt_tokens, entry.completion_tokens)
        return chunk

    def steer_chunk(self, entry):
        """Our extension: where steering took effect, on an otherwise empty delta so that a
        client that reads only `choices[0].delta` sees nothing unusual."""
        self.prompt_tokens = entry.prompt_tokens
        index = entry.i
        mark = {"steered": entry.text, **({"error": entry.error} if entry.error is not None else {})}
        chunk = self.chunk([{"index": index, "delta": {**self.opening(index), "content": ""}, "logprobs": None, "finish_reason": None}])
        return {**chunk, "tokstream": mark}

    def tool_chunk(self, entry):
        """As OpenAI streams a call: its index, id, type and name with empty arguments first,
        then only the index and each fragment of the arguments."""
        if isinstance(entry, ToolStart):
            call = {"index": entry.index, "id": entry.id, "type": "function", "function": {"name": entry.name, "arguments": ""}}
        else:
            call = {"index": entry.index, "function": {"arguments": entry.text}}
        index = entry.i
        chunk = self.chunk([{"index": index, "delta": {**self.opening(index), "tool_calls": [call]}, "logprobs": None, "finish_reason": None}])
        if entry.completion_tokens is not None:
            self.produced[index] = entry.completion_tokens
            if self.continuous_usage:  # a call's tokens count as they stream, as a text's do
                chunk["usage"] = usage_of(self.prompt_tokens, entry.completion_tokens)
        return chunk

    def end_chunks(self, entry):
        if entry.error is not None:
            chunks = [error_of(entry).body()]
        else:
            chunks = [self.finish_chunk(index, reason) for index, reason in enumerate(entry.finish_reasons)]
        # The usage chunk keeps its place (None) when not asked for, so event ids stay the same
        # whichever options a reader of the log chose.
        chunks.append({**self.chunk([]), "usage": entry.usage.to_dict()} if self.include_usage else None)
        return chunks

    def interrupted_chunks(self, error):
        """A stream that cannot go on: the error, and the usage so far when it was asked for."""
        usage = usage_of(self.prompt_tokens, sum(self.produced.values()))
        return [error.body(), {**self.chunk([]), "usage": usage} if self.include_usage else None]

    def finish_chunk(self, index, reason):
        delta = self.opening(index)
        if delta:  # a choice that said nothing still names its role, as OpenAI's do
            delta["content"] = ""
        return self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}])

    def chunk(self, choices):
        chunk = {**self.base, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk


def tool_calls(entries):
    calls = {}
    for entry in entries:
        if isinstance(entry, ToolStart):
            calls[entry.index] = {"id": entry.id, "type": "function", "function": {"name": entry.name, "arguments": ""}}
        elif isinstance(entry, ToolArgs):
            calls[entry.index]["function"]["arguments"] += entry.text
    return [calls[i] for i in sorted(calls)]


MAX_STREAM_SEQ = 2**64 - 1
# ASCII digits only, the whole value: \d takes any Unicode digit (full-width １ passed, and then
# Redis refused the id mid-stream) and $ a trailing newline.
EVENT_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})(\.[0-9]{1,4})?")


def valid_event_id(value):
    """An id this service could have sent: a Redis stream id (two 64-bit numbers, not 0-0),
    with an optional event number within the entry."""
    match = EVENT_ID.fullmatch(value)
    if not match:
        return False
    ms, seq = int(match[1]), int(match[2])
    return ms <= MAX_STREAM_SEQ and seq <= MAX_STREAM_SEQ and (ms, seq) != (0, 0)


def sse_frames(entry_id, payloads, done=False, skip=0):
    """One SSE event per payload. An entry that makes several events numbers all but its last
    ("T-S.0", "T-S.1", then "T-S"), so every event has an id and a resume can start mid-entry."""
    data = [p and json.dumps(p, separators=(",", ":")) for p in payloads] + (["[DONE]"] if done else [])
    ids = [f"{entry_id}.{k}" for k in range(len(data) - 1)] + [entry_id]
    return "".join(f"id: {i}\ndata: {d}\n\n" for i, d in list(zip(ids, data))[skip:] if d).encode()


def unnumbered_frames(payloads, done=True):
    """Events that are not in the log (a stream cut short, then [DONE]; a place in the queue):
    without ids, so a reconnect resumes from the last event that was."""
    data = [json.dumps(p, separators=(",", ":")) for p in payloads if p] + (["[DONE]"] if done else [])
    return "".join(f"data: {d}\n\n" for d in data).encode()


def resume_point(last_event_id):
    """Last-Event-ID -> (the log id to read after, how many events of the next entry were seen)."""
    entry_id, _, seen = last_event_id.partition(".")
    if not seen:
        return entry_id, 0
    ms, _, seq = entry_id.partition("-")
    before = f"{ms}-{int(seq) - 1}" if int(seq) > 0 else f"{int(ms) - 1}-{MAX_STREAM_SEQ}"
    return before, int(seen) + 1


UNAVAILABLE = ("worker_unavailable", "queue_timeout", "request_lost")  # the service's fault, not the request's


def error_of(end):
    """The error an end entry tells: an upstream's refusal keeps its status, type and param (and
    Retry-After); our own failures are 503 when the service was at fault, else 500."""
    if end.refusal:
        refusal = end.refusal
        headers = {"Retry-After": refusal.retry_after} if refusal.retry_after else {}
        return ApiError(refusal.status, end.error, type=refusal.type or "server_error", param=refusal.param, code=end.code, headers=headers)
    return ApiError(503 if end.code in UNAVAILABLE else 500, end.error, type="server_error", code=end.code)


def completion(admitted, deltas, end):
    """The non-streamed answer, from the delta entries and the end entry."""
    if end.error is not None:
        raise error_of(end)
    return {
        "id": admitted.request_id,
        "object": "chat.completion",
        "created": admitted.created,
        "model": admitted.model,
        "choices": [choice(index, [d for d in deltas if d.i == index], reason) for index, reason in enumerate(end.finish_reasons)],
        "usage": end.usage.to_dict(),
    }


def choice(index, entries, finish_reason):
    deltas = [e for e in entries if isinstance(e, Delta)]
    message = {"role": "assistant", "content": "".join(d.text for d in deltas)}
    calls = tool_calls(entries)
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None  # as OpenAI: no text, null content
    tokens = [token for d in deltas for token in d.logprobs or []]
    logprobs = {"content": tokens} if tokens else None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
