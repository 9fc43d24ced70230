"""A request for a local model: its choices submitted to this process's engine, their outputs
written to the request's log as they come (tool-call text parsed into call entries), and its
one ending billed from the token ids the engine consumed and produced.

This thread reads only the engine's Outputs (`Choice` keeps what they said of each choice);
the engine's Requests belong to its own thread."""

import logging
import queue
import time
from dataclasses import dataclass

from billing import ledger
from inference import lifecycle, streamlog
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
        stream_outputs(loop, admitted.request_id, prompt_ids, params, seen, client, tools, gaps)
    except Exception as exc:
        log.exception("request %s failed", admitted.request_id)
        for choice in seen:
            choice.fail(f"generation failed: {exc}")
    finally:
        finish_reasons = [c.finish_reason or FinishReason.ERROR for c in seen]
        provenance = local_provenance(seen, admitted.model, loop.model.tokenizer_id)
        lifecycle.end(client, admitted, outcome_of(seen), finish_reasons, gaps, provenance)


def stream_outputs(loop, request_id, prompt_ids, params, seen, client, tools=False, gaps=None):
    """Copy the engine's outputs to the log until every choice has finished; with tools, a
    parser per choice turns <tool_call> text into tool-call entries. The time between a
    choice's outputs goes to `gaps`."""
    outbox = loop.submit(request_id, prompt_ids, params, len(seen), claimed=True)
    parsers = {i: ToolCallParser() for i in range(len(seen))} if tools else {}
    last_output = {}
    running = len(seen)
    try:
        while running:
            output = next_output(loop, outbox)
            seen[output.index].take(output)
            if output.text and gaps is not None:
                now = time.monotonic()
                if output.index in last_output:
                    gaps.append(now - last_output[output.index])
                last_output[output.index] = now
            entries = log_entries(output, len(prompt_ids), seen, parsers.get(output.index))
            if entries:
                streamlog.append(client, request_id, *entries)
            if output.finished:
                running -= 1
                ended_with_calls(seen[output.index], parsers.get(output.index))
    except Exception as exc:
        # The log cannot take more: stop the engine too, and bill what it did up to then, as
        # a failure (not the client's cancel).
        loop.engine.cancel(request_id, error=f"the stream log failed: {exc}")
        wait_until_finished(outbox, running, seen)
        raise


def next_output(loop, outbox):
    """The engine thread always ends what it was given, unless it died: never wait for ever."""
    while True:
        try:
            return outbox.get(timeout=OUTPUT_CHECK_SECONDS)
        except queue.Empty:
            if not loop.is_alive():
                raise RuntimeError("the engine thread stopped") from None


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


def wait_until_finished(outbox, running, seen):
    deadline = time.monotonic() + DRAIN_SECONDS
    while running and time.monotonic() < deadline:
        try:
            output = outbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        seen[output.index].take(output)
        running -= output.finished


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
