"""A request for a local model: its choices submitted to this process's engine, their outputs
written to the request's log as they come (tool-call text parsed into call entries), and its
one ending billed from the token ids the engine consumed and produced."""

import logging
import queue
import time

from billing import ledger
from inference import lifecycle, streamlog
from inference.protocol.entries import Delta, FinishReason, Line, Steer, ToolArgs, ToolStart
from inference.protocol.tools import ToolCallParser
from inference.worker.engine import choices
from inference.worker.engines import LOST_CLAIM

log = logging.getLogger(__name__)
DRAIN_SECONDS = 30  # how long a request whose log failed waits for its engine to stop it
OUTPUT_CHECK_SECONDS = 5  # how often a task waiting on its engine checks the engine is alive
POLL_SECONDS = 1


def run_locally(client, loop, admitted, prompt_ids, params, tools):
    requests = choices(admitted.request_id, prompt_ids, params, admitted.n)
    gaps = []
    try:
        stream_outputs(loop, requests, client, tools, gaps)
    except Exception as exc:
        log.exception("request %s failed", admitted.request_id)
        for request in requests:
            if request.finish_reason is None:
                request.finish_reason, request.error = FinishReason.ERROR, f"generation failed: {exc}"
    finally:
        outcome = outcome_of(requests)
        finish_reasons = [r.finish_reason or FinishReason.ERROR for r in requests]
        provenance = local_provenance(requests, admitted.model, loop.model.tokenizer_id)
        lifecycle.end(client, admitted, outcome, finish_reasons, gaps, provenance)


def stream_outputs(loop, requests, client, tools=False, gaps=None):
    """Copy the engine's outputs to the log until every choice has finished; with tools, a
    parser per choice turns <tool_call> text into tool-call entries. The time between a
    choice's outputs goes to `gaps`."""
    outbox = loop.submit(*requests, claimed=True)
    parsers = {r.index: ToolCallParser() for r in requests} if tools else {}
    last_output = {}
    running = len(requests)
    try:
        while running:
            output = next_output(loop, outbox)
            if output.text and gaps is not None:
                now = time.monotonic()
                if output.index in last_output:
                    gaps.append(now - last_output[output.index])
                last_output[output.index] = now
            entries = log_entries(output, requests, parsers.get(output.index))
            if entries:
                streamlog.append(client, requests[0].group, *entries)
            if output.finished:
                running -= 1
                ended_with_calls(requests[output.index], parsers.get(output.index))
    except Exception as exc:
        # The log cannot take more: stop the engine too, and bill what it did up to then, as
        # a failure (not the client's cancel).
        loop.engine.cancel(requests[0].group, error=f"the stream log failed: {exc}")
        wait_until_finished(outbox, running)
        raise


def next_output(loop, outbox):
    """The engine thread always ends what it was given, unless it died: never wait for ever."""
    while True:
        try:
            return outbox.get(timeout=OUTPUT_CHECK_SECONDS)
        except queue.Empty:
            if not loop.is_alive():
                raise RuntimeError("the engine thread stopped") from None


def log_entries(output, requests, parser=None):
    if output.reading or output.ahead is not None:
        return [Line(output.ahead)]
    entries = [steer_entry(output, requests)] if output.steered else []
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


def ended_with_calls(request, parser):
    """A reply that made tool calls and stopped ends as OpenAI says: "tool_calls"."""
    if parser is not None and parser.calls and request.finish_reason == FinishReason.STOP:
        request.finish_reason = FinishReason.TOOL_CALLS


def steer_entry(output, requests):
    """Where steering took effect (or why it did not), and the prompt tokens since."""
    # The prompt and all steering so far (the engine counts it as it injects).
    prompt_tokens = len(requests[0].prompt_ids) + sum(r.steered_tokens for r in requests)
    return Steer(output.steered, prompt_tokens, output.index, output.error or None)


def wait_until_finished(outbox, running):
    deadline = time.monotonic() + DRAIN_SECONDS
    while running and time.monotonic() < deadline:
        try:
            running -= outbox.get(timeout=POLL_SECONDS).finished
        except queue.Empty:
            pass


def finish_reason_of(requests):
    return lifecycle.worst(r.finish_reason or FinishReason.ERROR for r in requests)


def prompt_tokens(requests):
    """The prompt once (as far as any choice consumed it; the others shared its cache), and
    every choice's steering."""
    steered = [r.steered_tokens for r in requests]
    return max(r.prefilled - s for r, s in zip(requests, steered)) + sum(steered)


def outcome_of(requests):
    errors = [r.error for r in requests if r.error]
    return lifecycle.Outcome(
        finish_reason=finish_reason_of(requests),
        prompt_tokens=prompt_tokens(requests),
        completion_tokens=sum(len(r.output_ids) for r in requests),
        error=errors[0] if errors else "",
        code="request_lost" if LOST_CLAIM in errors else None,
        started_at=earliest(r.started_at for r in requests),
        first_token_at=earliest(r.first_token_at for r in requests),
        finished_at=max((r.finished_at or time.time()) for r in requests),
    )


def earliest(times):
    times = [t for t in times if t is not None]
    return min(times) if times else None


def local_provenance(requests, model, tokenizer_id):
    return ledger.Provenance(
        model_served=model,
        tokenizer=tokenizer_id,
        cached_prompt_tokens=requests[0].cached_tokens,  # the prompt is billed once, as choice 0 read it
        steering_tokens=sum(r.steered_tokens for r in requests),
    )
