"""The entries of a request's log: what the worker (or the admission, or whoever ends a request)
writes, and what every reader reads. Each kind is a type, encoded to and from the log's JSON
here and nowhere else.

On the wire an entry is a JSON object whose "t" names its kind; fields at their default are
left out (`i`, the choice, is 0 for most). The format is the one logs have always had, so a
reader of this version reads a log an older worker wrote: a field renamed since keeps its
old key (`wire`), as `choices` and `completion_tokens` keep "n".
"""

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a choice ended, as OpenAI names it, plus the two endings of our own."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    CANCELLED = "cancelled"  # its client left, or asked to stop
    ERROR = "error"  # it failed: the end entry says why


@dataclass(frozen=True)
class Open:
    """The first entry: the stream opens with the role of each choice and the queue position."""

    choices: int = field(metadata={"wire": "n"})
    queue_position: int
    t = "open"


@dataclass
class Delta:
    """Text of one choice, and that choice's completion tokens so far."""

    text: str
    completion_tokens: int = field(metadata={"wire": "n"})
    i: int = 0
    logprobs: list | None = None
    t = "delta"


@dataclass(frozen=True)
class Steer:
    """Where steering took effect (or why not), and the prompt tokens counted since."""

    text: str
    prompt_tokens: int
    i: int = 0
    error: str | None = None
    t = "steer"


@dataclass(frozen=True)
class ToolStart:
    """A tool call begins: its index, id and function name (and, like a delta, the choice's
    completion tokens so far, when the writer knows them)."""

    index: int
    id: str
    name: str
    i: int = 0
    completion_tokens: int | None = field(default=None, metadata={"wire": "n"})
    t = "tool"


@dataclass(frozen=True)
class ToolArgs:
    """A fragment of a tool call's arguments (and the completion tokens so far)."""

    index: int
    text: str
    i: int = 0
    completion_tokens: int | None = field(default=None, metadata={"wire": "n"})
    t = "args"


@dataclass(frozen=True)
class Accepted:
    """An upstream model's server took the request (answered 200): its client may be answered
    200 too. Nothing a client sees."""

    t = "accepted"


@dataclass(frozen=True)
class Line:
    """Before its first token, where a request stands in its engine: `ahead` requests are in
    line before it (their prompts being read, or waiting to be), or, without `ahead`, its own
    prompt is being read. The chat page shows it; an API stream does not."""

    ahead: int | None = None
    t = "line"


def usage_of(prompt_tokens, completion_tokens):
    """OpenAI's usage object: every count a client is told, in the log, a chunk or an answer."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class Usage:
    """A request's token counts; in the log as OpenAI's usage object."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_dict(self):
        return usage_of(self.prompt_tokens, self.completion_tokens)

    @classmethod
    def from_dict(cls, data):
        return cls(data.get("prompt_tokens", 0), data.get("completion_tokens", 0))


@dataclass(frozen=True)
class Refusal:
    """An upstream's refusal before its first byte, as its client is to be told it (the message
    and the code are the end entry's `error` and `code`)."""

    status: int
    type: str | None = None
    param: str | None = None
    retry_after: str | None = None

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data):
        return cls(data["status"], data.get("type"), data.get("param"), data.get("retry_after"))


@dataclass(frozen=True)
class End:
    """The last entry: each choice's finish reason and the usage, or the error that ended it."""

    finish_reasons: list = field(default_factory=list)
    usage: Usage = Usage()
    error: str | None = None
    code: str | None = None
    refusal: Refusal | None = None
    t = "end"


KINDS = {kind.t: kind for kind in (Open, Delta, Steer, ToolStart, ToolArgs, Accepted, Line, End)}
Entry = Open | Delta | Steer | ToolStart | ToolArgs | Accepted | Line | End
TOOL_KINDS = (ToolStart, ToolArgs)
TEXT_KINDS = (Delta, ToolStart, ToolArgs)  # what a client sees as the reply's content


def choice_of(entry):
    """The choice an entry belongs to; the opening and the end belong to all (0 here)."""
    return getattr(entry, "i", 0)


@functools.cache
def layout(kind):
    """(every field's name and key on the wire, the defaults of those that have one) of a kind:
    read once, since every entry the worker writes and every one a reader sends passes through here."""
    fields = dataclasses.fields(kind)
    return tuple((f.name, f.metadata.get("wire", f.name)) for f in fields), {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}


NESTED = {"usage": Usage, "refusal": Refusal}  # fields that are types of their own, as JSON objects


def to_dict(entry):
    names, defaults = layout(type(entry))
    values = ((name, wire, getattr(entry, name)) for name, wire in names)
    kept = [(name, wire, value) for name, wire, value in values if name not in defaults or value != defaults[name] or name == "usage"]
    return {"t": entry.t, **{wire: value.to_dict() if name in NESTED and value is not None else value for name, wire, value in kept}}


def encode(entry):
    return json.dumps(to_dict(entry))


def from_dict(data):
    """The entry a JSON object encodes; a field this version does not know (a newer writer's)
    is left out, and a kind it does not know is None (its readers skip it), so that a log stays
    readable while processes of two versions run."""
    kind = KINDS.get(data["t"])
    if kind is None:
        return None
    names, _ = layout(kind)
    fields = {name: data[wire] for name, wire in names if wire in data}
    for name in NESTED.keys() & fields.keys():
        fields[name] = NESTED[name].from_dict(fields[name]) if fields[name] is not None else None
    return kind(**fields)


def decode(text):
    return from_dict(json.loads(text))
