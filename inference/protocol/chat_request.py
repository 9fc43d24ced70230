"""Parse and check a chat completion request body before anything is written or queued.

The body's shape is OpenAI's request schema, as pydantic models in strict mode: "1" is not an
integer, true is not a number, 1.0 is not an integer. Before them, a walk over the whole
document refuses what JSON can carry but nothing after us can keep; after them, the rules that
tie one field to another.

It imports nothing of the project outside protocol/, so that any process may parse: what it
must know of the models (whether one exists, its vocabulary) it asks of the `models` catalog
that the caller passes (backends.CATALOG)."""

import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    WrapValidator,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from inference.protocol.errors import ApiError, invalid, not_found
from inference.protocol.payloads import SamplingParams

ROLES = ("assistant", "developer", "system", "tool", "user")
ROLE_RULE = f"must be one of {', '.join(ROLES)}."
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # pydantic's regex: $ is the end of the text, a trailing newline does not pass
MAX_BEAM_WIDTH = 8
# No chat request needs more; deeper, copying the body (json.dumps, Celery) can run out of stack.
MAX_DEPTH = 64
TOKEN_ID = r"^[0-9]{1,9}$"  # ASCII digits only: str.isdigit() would also take "²" and "①"
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
# What pydantic's own error types mean, said after the field's name.
PHRASES = {
    "missing": "is required.",
    "bool_type": "must be a boolean.",
    "int_type": "must be an integer.",
    "float_type": "must be a number.",
    "string_type": "must be a string.",
    "model_type": "must be an object.",
    "dict_type": "must be an object.",
    "list_type": "must be an array.",
    "extra_forbidden": "is not an option of this server.",
    "greater_than_equal": "must be at least {ge}; got {input}.",
    "greater_than": "must be greater than {gt}; got {input}.",
    "less_than_equal": "must be at most {le}; got {input}.",
    "less_than": "must be less than {lt}; got {input}.",
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
    forced_tool: bool = False  # tool_choice "required" or a named function: the model must call one
    detach: bool = False  # keep running when the client of the POST leaves, for a later resume
    sampling: SamplingParams = SamplingParams()  # max_tokens is admission's to set
    sent: dict = field(default_factory=dict)  # the body as the client sent it: what an upstream is forwarded


# -- how an error is told ---------------------------------------------------------------------


def expected(phrase, inside_too=True):
    """Any error in the field becomes one error of the field, saying what it takes: a client
    learns the rule, not which branch of a union failed. With inside_too=False the errors of
    its items stay theirs (messages.[2].content), and only errors of the value itself are told."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError as exc:
            if not inside_too and any(error["loc"] for error in exc.errors()):
                raise
            raise PydanticCustomError("expected", phrase) from None

    return WrapValidator(validate)


def error_at(loc, phrase, value):
    """An error of a part of `value` (named by `loc`) rather than of the value itself."""
    return ValidationError.from_exception_data("ChatRequest", [InitErrorDetails(type=PydanticCustomError("expected", phrase), loc=loc, input=value)])


def refusal(exc):
    """The first of pydantic's errors (fields are checked in the order they are declared), as
    our OpenAI-shaped 400; an unknown model is a 404."""
    error = exc.errors(include_url=False)[0]
    param = param_of(error["loc"])
    if error["type"] == "model_not_found":
        return not_found(error["msg"], code="model_not_found", param=param)
    return invalid(f"`{param}` {phrase_of(error)}", param=param)


def param_of(loc):
    """A pydantic location as this API has always named params: messages.[2].content."""
    return ".".join(part if isinstance(part, str) else f"[{part}]" for part in loc) or "body"


def phrase_of(error):
    template = PHRASES.get(error["type"])
    if template is None:
        return error["msg"] if error["type"] == "expected" else f"is not valid: {error['msg']}."
    return template.format(input=error.get("input"), **error.get("ctx", {}))


# -- the body, as OpenAI's schema has it ------------------------------------------------------


class Strict(BaseModel):
    """Types as JSON has them, never coerced; fields this server does not read are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class NullMeansDefault(Strict):
    """A field sent as null is a field not given, as OpenAI's clients send them; not `value or
    default`, which took a wrong type that happens to be falsy (0, "", [], false) for "not given"."""

    @field_validator("*", mode="before")
    @classmethod
    def null_is_not_given(cls, value, info):
        definition = cls.model_fields[info.field_name]
        if value is None and not definition.is_required():
            return definition.get_default(call_default_factory=True)
        return value


class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart] | None, expected("must be a string or an array of text parts.")]


class Message(Strict):
    """A system, developer or user message: its role and its text are what this server reads;
    its other fields are checked as OpenAI's schema types them, so a wrong one is a 400."""

    role: Annotated[Literal[ROLES], expected(ROLE_RULE)]
    content: Content = None
    name: str | None = None


class CalledFunction(Strict):
    name: str
    arguments: str  # shown to the model as JSON when it parses as JSON, else as written


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(Message):
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class ToolMessage(Message):
    tool_call_id: str


def message_by_role(value):
    """Each role is read with its own fields; a message that is not an object has no role."""
    if not isinstance(value, dict):
        raise error_at(("role",), ROLE_RULE, value)
    role = value.get("role")
    by_role = {"assistant": AssistantMessage, "tool": ToolMessage}
    return (by_role.get(role, Message) if isinstance(role, str) else Message).model_validate(value)


Messages = Annotated[list[Annotated[Message, PlainValidator(message_by_role)]], Field(min_length=1), expected("must be a non-empty array.", inside_too=False)]


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict = Field(default_factory=dict)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class ForcedFunction(Strict):
    """tool_choice naming the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


TOOL_CHOICE_RULE = 'must be "auto", "none", "required" or {"type": "function", "function": {"name": "..."}}.'


class StreamOptions(NullMeansDefault):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Extension(NullMeansDefault):
    """Our own options, under `tokstream` so that no OpenAI parameter is shadowed."""

    model_config = ConfigDict(extra="forbid")
    beam_width: Annotated[int, Field(ge=1, le=MAX_BEAM_WIDTH)] = 1
    detach_on_disconnect: bool = False
    speculative: bool = True  # false: no prompt-lookup drafts for this request


StopText = Annotated[str, Field(min_length=1)]


class Body(NullMeansDefault):
    """POST /v1/chat/completions. The fields are in the order their errors are told: the model
    first (an unknown one is a 404 whatever else is wrong), then OpenAI's and vLLM's parameters."""

    model: Annotated[str, Field(min_length=1), expected("must be a non-empty string.")]
    messages: Messages
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's older name for max_completion_tokens
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    tools: Annotated[list[Tool], expected('must be a list of {"type": "function", "function": {"name", "description", "parameters"}}.')] = Field(
        default_factory=list
    )
    tool_choice: Annotated[Literal["auto", "none", "required"] | ForcedFunction, expected(TOOL_CHOICE_RULE)] = "auto"
    tokstream: Extension = Field(default_factory=Extension)
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # -1 and 0 are both "off"
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    logit_bias: Annotated[
        dict[Annotated[str, Field(pattern=TOKEN_ID)], Annotated[float, Field(ge=-100.0, le=100.0)]],
        expected("must map token ids (strings of digits) to numbers in [-100, 100]."),
    ] = Field(default_factory=dict)
    seed: Annotated[int, Field(gt=-MAX_SEED, lt=MAX_SEED), expected("must be an integer within a 64-bit integer's range.")] | None = None
    stop: Annotated[StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)], expected(f"must be a non-empty string or up to {MAX_STOP} of them.")] = (
        Field(default_factory=list)
    )
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("model")
    @classmethod
    def model_exists(cls, name, info):
        if not info.context["models"].exists(name):
            raise PydanticCustomError("model_not_found", "The model `{name}` does not exist.", {"name": name})
        return name

    @field_validator("logit_bias")
    @classmethod
    def in_the_vocabulary(cls, bias, info):
        """Only a known model has a vocabulary; an unknown one is told of first."""
        model = info.data.get("model")
        vocabulary = info.context["models"].vocabulary_size(model) if bias and model else 0
        for token in bias:
            if int(token) >= vocabulary:
                raise PydanticCustomError("expected", "has {token}, which is not a token id of this model.", {"token": repr(token)})
        return bias


# -- parse ------------------------------------------------------------------------------------


def parse(body, content_type, models):
    """The checked request; `models` answers exists(name) and vocabulary_size(name)."""
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise invalid("Content-Type must be application/json.")
    data = json_object(body)
    check_values(data)
    try:
        checked = Body.model_validate(data, context={"models": models})
    except ValidationError as exc:
        raise refusal(exc) from None
    check_combinations(checked)
    return chat_of(checked, data)


def chat_of(body, data):
    options = body.stream_options or StreamOptions()
    return ChatRequest(
        model=body.model,
        messages=[message_of(m) for m in body.messages],
        stream=body.stream,
        include_usage=options.include_usage,
        continuous_usage=options.continuous_usage_stats,
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        n=body.n,
        tools=data["tools"] if body.tools and body.tool_choice != "none" else [],  # as sent: the prompt and an upstream show them
        forced_tool=body.tool_choice not in ("auto", "none"),
        detach=body.tokstream.detach_on_disconnect,
        sampling=sampling_of(body),
        sent=data,
    )


def sampling_of(body):
    """OpenAI's sampling parameters, and vLLM's top_k, min_p and repetition_penalty."""
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias={int(token): value for token, value in body.logit_bias.items()},
        seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else body.stop,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        beam_width=body.tokstream.beam_width,
        speculative=body.tokstream.speculative,
    )


def message_of(message):
    checked = {"role": "system" if message.role == "developer" else message.role, "content": content_text(message.content)}
    if getattr(message, "tool_calls", None) is not None:
        checked["tool_calls"] = [{"name": call.function.name, "arguments": arguments_of(call.function.arguments)} for call in message.tool_calls]
    return checked


def content_text(content):
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def arguments_of(text):
    """Arguments that parse (sanely) as JSON are shown to the model as JSON; others as written."""
    try:
        arguments = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return text if first_problem(arguments) else arguments


def check_combinations(body):
    """What no single field can say wrong about itself."""
    if body.stream_options is not None and not body.stream:
        raise invalid("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    if body.top_logprobs and not body.logprobs:
        raise invalid("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
    check_beam_search(body)
    check_tool_choice(body)


def check_tool_choice(body):
    """A forced call needs something to call (OpenAI's rule too), and a named one a tool of
    that name."""
    if body.tool_choice in ("auto", "none"):
        return
    if not body.tools:
        raise invalid('`tool_choice` other than "auto" or "none" needs `tools`.', param="tool_choice")
    if isinstance(body.tool_choice, ForcedFunction) and body.tool_choice.function.name not in {t.function.name for t in body.tools}:
        raise invalid(f"`tool_choice` names `{body.tool_choice.function.name}`, which is not one of `tools`.", param="tool_choice")


def check_beam_search(body):
    """Beam search is deterministic and keeps whole sequences: say what it cannot do rather
    than drop it silently. (temperature, top_p, top_k, min_p and seed do not apply to it.)"""
    if body.tokstream.beam_width == 1:
        return
    if body.n != 1:
        raise invalid("`n` cannot be combined with `tokstream.beam_width`.", param="n")
    sampling = sampling_of(body)
    for name, neutral in BEAM_SEARCH_EXCLUDES.items():
        if getattr(sampling, name) != neutral:
            raise invalid(f"`{name}` cannot be combined with `tokstream.beam_width`.", param=name)


# -- the JSON document ------------------------------------------------------------------------


def json_object(body, message="The body must be a JSON object."):
    """The body as a dict: every JSON endpoint of ours takes an object."""
    data = json_of(body)
    if not isinstance(data, dict):
        raise invalid(message)
    return data


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
    text and jsonb cannot hold it) and deep nesting. In every field, those we do not read too
    (`user`, a tool's schema): they are stored and sent on."""
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


def checked_max_tokens(chat, prompt_tokens, context_length, default):
    """The completion budget, or the error OpenAI gives when prompt + budget cannot fit in the
    context (the model's, or the worker's KV cache if smaller)."""
    room = context_length - prompt_tokens
    if room < 1:
        raise ApiError(
            400,
            f"This model's maximum context length is {context_length} tokens; the messages use {prompt_tokens}. Please shorten them.",
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
