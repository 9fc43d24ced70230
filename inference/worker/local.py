"""A request for a local model: its choices submitted to this process's engine, their outputs
written to the request's log as they come (tool-call text parsed into call entries), and its
one ending billed from the token ids the engine consumed and produced.

The engine loop's thread turns the outputs into log entries (RequestLog); it and this thread
read only the engine's Outputs (`Choice` keeps what they said of each choice): the engine's
Requests belong to the engine."""

import logging
import threading
import time
from dataclasses import dataclass

from billing import ledger
from inference import lifecycle
from inference.protocol.entries import Delta, FinishReason, Line, Steer, ToolArgs, ToolStart
from inference.protocol.tools import ToolCallParser
from inference.worker.engines import LOST_CLAIM

log = logging.getLogger(__name__)
DRAIN_SECONDS = 30  # how long a request whose log failed waits for its engine to stop it
OUTPUT_CHECK_SECONDS = 5  # how often a task waiting on its engine checks the engine is alive
POLL_SECONDS = 1


@dataclass
class Choice:
    """What the engine's outputs said of one choice so far."""

    completion_tokens: int = 0
    steered_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    totals: object = None  # engine.Totals, from its finished output

    def take(self, output):
        self.completion_tokens = max(self.completion_tokens, output.completion_tokens)
        self.steered_tokens = max(self.steered_tokens, output.steered_tokens)
        if output.finished:
            self.finish_reason, self.error, self.totals = output.finish_reason, output.error, output.totals

    def fail(self, error):
        """The worker's own ending for a choice the engine did not end (it stopped telling)."""
        if self.finish_reason is None:
            self.finish_reason, self.error = FinishReason.ERROR, error


def run_locally(client, loop, admitted, prompt_ids, params, tools):
    seen = [Choice() for _ in range(admitted.n)]
    gaps = []
    try:
        stream_outputs(loop, admitted.request_id, prompt_ids, params, seen, tools, gaps)
    except Exception as exc:
        log.exception("request %s failed", admitted.request_id)
        for choice in seen:
            choice.fail(f"generation failed: {exc}")
    finally:
        finish_reasons = [c.finish_reason or FinishReason.ERROR for c in seen]
        provenance = local_provenance(seen, admitted.model, loop.model.tokenizer_id)
        lifecycle.end(client, admitted, outcome_of(seen), finish_reasons, gaps, provenance)


def stream_outputs(loop, request_id, prompt_ids, params, seen, tools=False, gaps=None):
    """Have the engine loop write the request's outputs to its log until every choice has
    finished (RequestLog); raises when the log failed or the engine thread stopped."""
    request_log = RequestLog(request_id, len(prompt_ids), seen, tools, gaps)
    loop.submit(request_id, prompt_ids, params, len(seen), claimed=True, sink=request_log)
    request_log.wait(loop)


class RequestLog:
    """One request's outputs turned into its log's entries, with tools by a parser per choice
    (<tool_call> text into tool-call entries). The engine loop calls `take` for each output, on
    its own thread, and writes the entries of every request of a step in one Redis round trip
    (EngineLoop.deliver): 32 task threads each waking to write their own token stretched the
    engine's step at 32 streams (BENCHMARKS.md). The request's task thread only waits for the
    end. The time between a choice's outputs goes to `gaps`."""

    EXPIRY_PUSH_SECONDS = 1.0

    def __init__(self, request_id, prompt_length, seen, tools=False, gaps=None):
        self.request_id, self.prompt_length, self.seen, self.gaps = request_id, prompt_length, seen, gaps
        self.parsers = {i: ToolCallParser() for i in range(len(seen))} if tools else {}
        self.last_output = {}
        self.running = len(seen)
        self.pushed_at = None  # when the log's expiry was last pushed forward
        self.error = None  # why the log could not be written: nothing more goes to it
        self.done = threading.Event()

    # -- on the engine loop's thread

    def take(self, output):
        """-> the output's log entries."""
        choice, parser = self.seen[output.index], self.parsers.get(output.index)
        choice.take(output)
        if output.text and self.gaps is not None:
            self.time_gap(output.index)
        try:
            return [] if self.error is not None else log_entries(output, self.prompt_length, self.seen, parser)
        finally:
            if output.finished:  # after the parser's last entries: they may hold a call
                self.running -= 1
                ended_with_calls(choice, parser)

    def time_gap(self, index):
        now = time.monotonic()
        if index in self.last_output:
            self.gaps.append(now - self.last_output[index])
        self.last_output[index] = now

    def push_expiry(self):
        """Whether this write should push the log's expiry forward (streamlog.append_each)."""
        now = time.monotonic()
        if self.pushed_at is not None and now - self.pushed_at < self.EXPIRY_PUSH_SECONDS and self.running:
            return False
        self.pushed_at = now
        return True

    def failed(self, exc):
        """The log could not take this step's entries (or they could not be made): the engine
        stops the request, and it is billed as a failure, not as its client's cancel."""
        self.error = self.error or f"the stream log failed: {exc}"
        return self.error

    def written(self):
        if not self.running:
            self.done.set()

    # -- on the request's task thread

    def wait(self, loop):
        """Until every choice has finished. The engine thread always ends what it was given,
        unless it died: never wait for ever; nor longer than DRAIN_SECONDS once the log failed."""
        drain_until = None
        while not self.done.wait(OUTPUT_CHECK_SECONDS if drain_until is None else POLL_SECONDS):
            if not loop.is_alive():
                raise RuntimeError("the engine thread stopped")
            if self.error is not None:
                drain_until = drain_until or time.monotonic() + DRAIN_SECONDS
                if time.monotonic() > drain_until:
                    break
        if self.error is not None:
            raise RuntimeError(self.error)


def log_entries(output, prompt_length, seen, parser=None):
    if output.reading or output.ahead is not None:
        return [Line(output.ahead)]
    entries = [steer_entry(output, prompt_length, seen)] if output.steered else []
    if parser is None:
        events = [("content", output.text)] if output.text else []
    else:
        events = parser.feed(output.text) + (parser.finish() if output.finished else [])
    entries += [event_entry(output, event) for event in events]
    if output.logprobs:  # they go with the step's first text, or alone
        deltas = [e for e in entries if isinstance(e, Delta)] or [append_to(entries, Delta("", output.completion_tokens, output.index))]
        deltas[0].logprobs = output.logprobs
    return entries


def append_to(entries, entry):
    entries.append(entry)
    return entry


def event_entry(output, event):
    if event[0] == "content":
        return Delta(event[1], output.completion_tokens, output.index)
    if event[0] == "call":
        return ToolStart(event[1], event[2], event[3], output.index, output.completion_tokens)
    return ToolArgs(event[1], event[2], output.index, output.completion_tokens)


def ended_with_calls(choice, parser):
    """A reply that made tool calls and stopped ends as OpenAI says: "tool_calls"."""
    if parser is not None and parser.calls and choice.finish_reason == FinishReason.STOP:
        choice.finish_reason = FinishReason.TOOL_CALLS


def steer_entry(output, prompt_length, seen):
    """Where steering took effect (or why it did not), and the prompt tokens since: the prompt
    and every choice's steering so far."""
    return Steer(output.steered, prompt_length + sum(c.steered_tokens for c in seen), output.index, output.error or None)


def prompt_tokens(seen):
    """The prompt once (as far as any choice consumed it; the others shared its cache), and
    every choice's steering."""
    prompts = [c.totals.prefilled - c.totals.steered_tokens for c in seen if c.totals]
    return max(prompts, default=0) + sum(c.steered_tokens for c in seen)


def outcome_of(seen):
    errors = [c.error for c in seen if c.error]
    totals = [c.totals for c in seen if c.totals]
    return lifecycle.Outcome(
        finish_reason=lifecycle.worst(c.finish_reason or FinishReason.ERROR for c in seen),
        prompt_tokens=prompt_tokens(seen),
        completion_tokens=sum(len(c.totals.token_ids) if c.totals else c.completion_tokens for c in seen),
        error=errors[0] if errors else "",
        code="request_lost" if LOST_CLAIM in errors else None,
        started_at=earliest(t.started_at for t in totals),
        first_token_at=earliest(t.first_token_at for t in totals),
        finished_at=max((c.totals.finished_at if c.totals and c.totals.finished_at else time.time()) for c in seen),
    )


def earliest(times):
    times = [t for t in times if t is not None]
    return min(times) if times else None


def local_provenance(seen, model, tokenizer_id):
    first = seen[0].totals
    return ledger.Provenance(
        model_served=model,
        tokenizer=tokenizer_id,
        cached_prompt_tokens=first.cached_tokens if first else 0,  # the prompt is billed once, as choice 0 read it
        steering_tokens=sum(c.steered_tokens for c in seen),
    )
