"""The Celery side: run one request on this process's engine and relay it to the Redis log.

Whatever happens, the request ends with exactly one ledger entry and an end entry in its log,
so no client is left waiting.
"""

import dataclasses
import logging
import os
import queue
import threading
import time

from celery import shared_task
from celery.signals import task_received, worker_ready, worker_shutdown, worker_shutting_down
from celery.worker import state as worker_state

from billing import ledger
from inference import lifecycle, registry, streamlog, upstream
from inference.protocol.entries import Delta, FinishReason, Line, Steer, ToolArgs, ToolStart
from inference.protocol.payloads import GENERATE, GenerateTask
from inference.protocol.tools import ToolCallParser
from inference.worker.engine import choices
from inference.worker.loops import LOST_CLAIM, Sweeper, drain_own_beats, engine_loop, forget_own_beats, forget_stopped_here, reserve
from inference.worker.relay import Relay

log = logging.getLogger(__name__)
DRAIN_SECONDS = 30
OUTPUT_CHECK_SECONDS = 5  # how often a task waiting on its engine checks the engine is alive


@shared_task(name=GENERATE)
def generate(**fields):
    task = GenerateTask(**fields)
    facts = lifecycle.Facts.of_task(task)
    client = streamlog.sync_client()
    loop = engine_loop(task.model)
    relayed = task.upstream_body is not None
    verdict = lifecycle.claim(client, task.request_id, task.model, loop.worker_id, keep_queued=relayed)
    if verdict in (lifecycle.Claim.RUNNING, lifecycle.Verdict.ENDED):
        return  # a second delivery: the first is running it, or it is over
    if verdict != lifecycle.Claim.CLAIMED:
        # Its client left, its deadline passed, Redis lost it, or its worker died: never run.
        return lifecycle.end_abandoned(client, facts, verdict)
    if relayed:
        return relay_upstream(client, facts, task.upstream_body, loop.worker_id, task.max_tokens)
    run_locally(client, loop, facts, task.prompt_ids, task.params, task.tools)


def run_locally(client, loop, facts, prompt_ids, params, tools):
    requests = choices(facts.request_id, prompt_ids, params, facts.n)
    gaps = []
    try:
        relay(loop, requests, client, tools, gaps)
    except Exception as exc:
        log.exception("request %s failed", facts.request_id)
        for request in requests:
            if request.finish_reason is None:
                request.finish_reason, request.error = FinishReason.ERROR, f"generation failed: {exc}"
    finally:
        outcome = outcome_of(requests)
        finish_reasons = [r.finish_reason or FinishReason.ERROR for r in requests]
        provenance = local_provenance(requests, facts.model, loop.model.tokenizer_id)
        lifecycle.end(client, facts, outcome, finish_reasons, gaps, provenance)


def relay_upstream(client, facts, body, worker_id, max_tokens):
    """A request for an upstream model: its stream relayed into the log, billed as the
    upstream's usage says (our count beside it), or by our count as an estimate."""
    relay = Relay(facts.model, facts.request_id)
    try:
        relay.run(client, body, worker_id, max_tokens)
    except Exception as exc:
        log.exception("request %s failed", facts.request_id)
        relay.fail(f"the relay failed: {exc}")
    finally:
        counted_prompt = facts.prompt_tokens if relay.sent else 0  # a request the upstream never took costs nothing
        prompt_tokens, completion_tokens, provenance = upstream_billing(relay, counted_prompt, counted_completion(relay))
        outcome = lifecycle.Outcome(
            relay.finish_reason, prompt_tokens, completion_tokens, relay.error, relay.started_at, relay.first_token_at, time.time(), relay.code, relay.refusal
        )
        lifecycle.end(client, facts, outcome, [relay.finish_reason], provenance=provenance)


def counted_completion(relay):
    """Our count of the reply; should counting itself fail, the sum of its deltas' counts, so
    the request still ends, billed, and its client is told."""
    try:
        return relay.completion_tokens()
    except Exception:
        log.exception("could not count the reply of %s", relay.request_id)
        return relay.counted


def relay(loop, requests, client, tools=False, gaps=None):
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
            running -= outbox.get(timeout=1).finished
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


def upstream_billing(relay, counted_prompt, counted_completion):
    """(prompt tokens billed, completion tokens billed, the entry's Provenance): the
    upstream's usage when it reported it, our count beside it; otherwise our count, marked as
    an estimate, with nothing to compare it to."""
    ours = ledger.Provenance(
        usage_source=upstream.ESTIMATED,
        model_served=relay.backend.served_model,
        tokenizer=relay.backend.tokenizer_id(),
        vendor_request_id=relay.vendor_id,
        counted_prompt_tokens=counted_prompt,
        counted_completion_tokens=counted_completion,
    )
    reported = upstream.vendor_counts(relay.vendor_usage)
    if reported is None:
        return counted_prompt, counted_completion, ours
    prompt, cached, completion = reported
    theirs = dataclasses.replace(
        ours, usage_source=upstream.FROM_UPSTREAM, cached_prompt_tokens=min(cached, prompt),
        vendor_prompt_tokens=prompt, vendor_cached_prompt_tokens=cached, vendor_completion_tokens=completion,
    )  # fmt: skip
    return prompt, completion, theirs


@worker_ready.connect
def load_models(**kwargs):
    # Load every model before the first task arrives, once per worker process (threads pool).
    # Celery's SIGTERM and SIGQUIT handlers only set a flag that its main loop reads, and this
    # handler holds the main thread: the load runs in a thread while this one watches the flag.
    # Celery logs and swallows a signal handler's exception; a worker without its model must
    # not stay up taking tasks, so it exits.
    log.info("loading the models: %s", ", ".join(registry.names()))
    failed = []
    loading = threading.Thread(target=load_every_model, args=(failed,), name="load models", daemon=True)
    loading.start()
    while loading.is_alive():
        loading.join(0.2)
        if worker_state.should_stop is not None or worker_state.should_terminate is not None:
            log.warning("asked to stop while loading the models: stopping before taking any task")
            os._exit(0)
    if failed:
        log.critical("the worker could not load its models", exc_info=failed[0])
        os._exit(3)
    Sweeper().start()


def load_every_model(failed):
    try:
        forget_stopped_here(streamlog.sync_client())
        for name in registry.names():
            engine_loop(name)
    except Exception as exc:
        failed.append(exc)


@worker_shutting_down.connect
def begin_draining(**kwargs):
    # Sent from Celery's SIGTERM, SIGQUIT and SIGINT handlers, before the drain.
    try:
        drain_own_beats(streamlog.sync_client())
    except Exception:  # Redis away: admission cannot queue anything either
        log.warning("could not mark this worker's heartbeats draining", exc_info=True)


@worker_shutdown.connect
def stop_beating(**kwargs):
    # After the warm shutdown's drain: the requests it ran have ended.
    try:
        forget_own_beats(streamlog.sync_client())
    except Exception:  # Redis away: the beats run out within TOKSTREAM_WORKER_TTL anyway
        log.warning("could not remove this worker's heartbeats", exc_info=True)


@task_received.connect
def reserve_request(request=None, **kwargs):
    # Prefetched, not yet running: should this worker die, the request's readers must know.
    try:
        reserve(request.kwargs["request_id"], request.kwargs["model"])
    except Exception:  # the request still runs; its readers just learn less
        log.warning("could not mark a prefetched request", exc_info=True)
