"""What crosses between the processes, one type each with its encoding beside it: the task the
gateway sends a worker (`GenerateTask`), a request's metadata and state in Redis (`RequestMeta`,
`State`), a worker's heartbeat (`Beat`), and how a request samples (`SamplingParams`).

An admitted request has one shape in every process, `Admitted`; the task, the metadata and the
database's pending row each carry it and give it back (`admitted()`).

The gateway sends the task by name (it never imports the worker); the pending row keeps it, should the
request need sending again. On the wire it is the task's keyword arguments, a JSON object.
"""

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum

GENERATE = "inference.tasks.generate"  # the task's name, as workers register it
# Below this a temperature is greedy: dividing by it would overflow the logits (as in vLLM).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: OpenAI's parameters, vLLM's top_k, min_p and repetition_penalty,
    and our own (beam search, drafts)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    beam_width: int = 1  # above 1: beam search (deterministic; the sampling knobs do not apply)
    speculative: bool = True  # prompt-lookup drafts where the engine finds them worth it

    @property
    def greedy(self):
        return self.temperature < MIN_TEMPERATURE

    @property
    def penalised(self):
        """The logits depend on the output so far: each token must be seen before the next."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, fields):
        """From its JSON object (a Celery message's), whose keys JSON made strings."""
        bias = {int(token): float(value) for token, value in fields.get("logit_bias", {}).items()}
        return cls(**{**fields, "logit_bias": bias})


@dataclass(frozen=True)
class GenerateTask:
    request_id: str
    model: str
    prompt_ids: list  # the ids the local model reads; empty for an upstream
    params: SamplingParams  # max_tokens included
    received_at: float
    prompt_tokens: int = 0  # as billed: len(prompt_ids), or the upstream's count
    n: int = 1
    tools: bool = False  # parse <tool_call> text into tool-call entries
    upstream_body: dict | None = None  # what the worker sends an upstream model
    api_key_id: int | None = None
    user_id: int | None = None

    def __post_init__(self):
        if isinstance(self.params, dict):  # as the task's JSON arguments carry it
            object.__setattr__(self, "params", SamplingParams.from_dict(self.params))

    def as_kwargs(self):
        """The task's JSON arguments. Not `dataclasses.asdict`, which deep-copies every prompt id
        one by one (`bench/admission.py --profile`)."""
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**fields, "prompt_ids": list(self.prompt_ids), "params": dataclasses.asdict(self.params)}

    def summary(self):
        """What the worker's log says of the task, in place of Celery's repr of its arguments."""
        return f"{{'request_id': {self.request_id!r}, 'model': {self.model!r}, 'prompt_tokens': {self.prompt_tokens}}}"

    def admitted(self):
        # `created` is the web's, for its chunks: here, the second the request came in.
        return Admitted(self.request_id, self.model, int(self.received_at), self.prompt_tokens, self.n, self.received_at, self.api_key_id, self.user_id)

    @property
    def max_tokens(self):
        return self.params.max_tokens


def _flag(value):
    return value in ("1", "True", "true")


def _number(kind, value):
    return kind(float(value)) if value not in (None, "") else None


@dataclass(frozen=True)
class Admitted:
    """One admitted request: what its stream, its ending and its bill need of it."""

    request_id: str
    model: str
    created: int  # the chunks' `created`, a whole second (the web reads it from the metadata)
    prompt_tokens: int  # as billed: the ids the local model reads, or the upstream's count
    n: int = 1
    received_at: float = 0.0
    api_key_id: int | None = None
    user_id: int | None = None


@dataclass(frozen=True)
class RequestMeta:
    """What Redis keeps beside an admitted request's log (its `meta` hash): what admission knows,
    enough to bill it should its worker die, and what workers and enders add. Every Python reader
    goes through `from_redis`; the Lua scripts name its fields from `META_FIELDS`."""

    owner: str  # the key or the user it belongs to, as `Owner.label` says
    model: str
    created: int
    prompt_tokens: int
    received_at: float
    deadline: float  # the queue's deadline, fixed at admission
    n: int = 1
    api_key_id: int | None = None
    user_id: int | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    worker: str | None = None  # the worker that prefetched it, then the one that claimed it
    claim: str | None = None  # the token of the claim that took it
    ran: bool = False  # a worker claimed it: its prompt was read
    ending_at: float | None = None  # when its ender took it over

    def admitted(self, request_id):
        return Admitted(request_id, self.model, self.created, self.prompt_tokens, self.n, self.received_at, self.api_key_id, self.user_id)

    def to_redis(self):
        """The hash admission writes: strings, without the fields nobody set."""
        fields = dataclasses.asdict(self)
        return {name: str(int(value) if isinstance(value, bool) else value) for name, value in fields.items() if value is not None}

    @classmethod
    def from_redis(cls, fields):
        """The metadata from its hash; None when Redis no longer has it."""
        if not fields:
            return None
        return cls(
            owner=fields["owner"],
            model=fields["model"],
            created=int(fields["created"]),
            prompt_tokens=int(fields["prompt_tokens"]),
            received_at=float(fields["received_at"]),
            deadline=float(fields["deadline"]),
            n=int(fields.get("n", 1)),
            api_key_id=_number(int, fields.get("api_key_id")),
            user_id=_number(int, fields.get("user_id")),
            include_usage=_flag(fields.get("include_usage")),
            continuous_usage=_flag(fields.get("continuous_usage")),
            worker=fields.get("worker") or None,
            claim=fields.get("claim") or None,
            ran=_flag(fields.get("ran")),
            ending_at=_number(float, fields.get("ending_at")),
        )


META_FIELDS = tuple(field.name for field in dataclasses.fields(RequestMeta))  # as Lua scripts name them


class State(StrEnum):
    """Where a request stands: its state key holds one, with the worker that runs it (Status)."""

    QUEUED = "queued"
    RUNNING = "running"
    ENDING = "ending"
    ENDED = "ended"


@dataclass(frozen=True)
class Status:
    """A request's state key: its State, and for a running request the worker that holds it
    (kept as `running <worker>`, the form the Lua scripts write and compare)."""

    state: State
    worker: str = ""

    def to_redis(self):
        return f"{self.state} {self.worker}" if self.worker else str(self.state)

    @classmethod
    def from_redis(cls, value):
        """None for a missing key."""
        if value is None:
            return None
        state, _, worker = value.partition(" ")
        return cls(State(state), worker)

    def holder(self):
        """The worker that runs it, else None."""
        return self.worker if self.state == State.RUNNING else None


@dataclass(frozen=True)
class Beat:
    """A worker's heartbeat for one model (a field of the workers hash, `host:pid:boot:device:model`)."""

    model: str
    until: float  # live until then
    running: int = 0
    waiting: int = 0
    draining: bool = False  # finishing what it runs, taking nothing new

    def to_redis(self):
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_redis(cls, text):
        fields = json.loads(text)
        return cls(fields["model"], float(fields["until"]), int(fields.get("running", 0)), int(fields.get("waiting", 0)), bool(fields.get("draining", False)))

    def live(self, now):
        return self.until >= now
