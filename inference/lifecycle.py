"""One request's life, the same whoever ends it.

Admitted: a pending row in the database (with its budget hold) and, in Redis, its metadata,
its log and its state key, "queued". A worker that prefetched it names itself in the metadata,
so readers watch that worker. Claimed, atomically, by one worker: "running <worker>". Ended
once: the ledger entry, the hold given back and the pending row removed in one transaction;
then the end entry and the state "ended" in one Redis step. Whoever ends it (its worker, a
reader that found the worker dead, a worker that finds it unclaimable, or the sweeper) goes
through `end`, and a second ender finds the ledger row and the "ended" state and adds nothing.
"""

import logging
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from billing import budgets, ledger
from inference import metrics, streamlog
from inference.models import PendingRequest
from inference.protocol.entries import Delta, End, FinishReason, encode, usage_of
from inference.signals import request_finished

log = logging.getLogger(__name__)
ENDING, ENDED, RUNNING = "ending", "ended", "running "
# Why a request could not run, as its end entry says (and a non-streamed answer's 503).
CODES = {"expired": "queue_timeout", "lost": "request_lost", "orphaned": "worker_unavailable", "unserved": "worker_unavailable"}
MESSAGES = {
    "expired": "The request waited longer than TOKSTREAM_QUEUE_TIMEOUT for a worker; it was not run.",
    "lost": "The request's state was lost (Redis restarted) before it ended.",
    "orphaned": "The worker running the request stopped answering; the request was abandoned.",
    "unserved": "No worker took the request: the workers of its model stopped or are shutting down; it was not run.",
}

CLAIM = """
local state = redis.call('GET', KEYS[1])
if not state then return 'lost' end
if state == 'ended' or state == 'ending' then return 'ended' end
if string.sub(state, 1, 8) == 'running ' then
  -- this very claim, tried again after its reply was lost
  if redis.call('HGET', KEYS[3], 'claim') == ARGV[5] then return 'claimed' end
  local beat = redis.call('HGET', KEYS[5], string.sub(state, 9) .. ':' .. ARGV[4])
  if beat and cjson.decode(beat)['until'] >= tonumber(ARGV[2]) then return 'running' end
  redis.call('SET', KEYS[1], 'ending', 'KEEPTTL')
  redis.call('HSET', KEYS[3], 'ending_at', ARGV[2])
  return 'orphaned'
end
local verdict = 'claimed'
local deadline = redis.call('HGET', KEYS[3], 'deadline')
if redis.call('EXISTS', KEYS[2]) == 1 then verdict = 'cancelled'
elseif deadline and tonumber(ARGV[2]) > tonumber(deadline) then verdict = 'expired' end
if verdict ~= 'claimed' or ARGV[6] ~= 'keep' then redis.call('ZREM', KEYS[4], ARGV[3]) end
if verdict ~= 'claimed' then
  redis.call('SET', KEYS[1], 'ending', 'KEEPTTL')
  redis.call('HSET', KEYS[3], 'ending_at', ARGV[2])
  return verdict
end
redis.call('SET', KEYS[1], 'running ' .. ARGV[1], 'KEEPTTL')
redis.call('HSET', KEYS[3], 'worker', ARGV[1], 'claim', ARGV[5], 'ran', '1')
return verdict
"""

RESERVE = """
if redis.call('GET', KEYS[1]) == 'queued' then redis.call('HSET', KEYS[2], 'worker', ARGV[1]) end
"""

TAKE_OVER = """
local state = redis.call('GET', KEYS[1])
if ARGV[1] == '' then
  if state then return 0 end
  redis.call('SET', KEYS[1], 'ending', 'EX', ARGV[2])
  return 1
end
if state ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], 'ending', 'KEEPTTL')
redis.call('HSET', KEYS[2], 'ending_at', ARGV[3])
return 1
"""

FINISH = """
if redis.call('GET', KEYS[2]) == 'ended' then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'e', ARGV[1])
redis.call('SET', KEYS[2], 'ended', 'EX', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
"""


def state_key(request_id):
    return streamlog.key(request_id, "state")


def claim(client, request_id, model, worker_id, keep_queued=False):
    """'claimed' (run it), 'running' (a live worker has it: a duplicate), 'ended', or why it
    must end unrun: 'cancelled', 'expired', 'lost', 'orphaned' (its worker died). The token
    tells this claim, tried again, from a second delivery. A request that `keep_queued` stays
    in its model's queue (a relayed one, until its upstream has a slot for it)."""
    keys = [state_key(request_id), streamlog.key(request_id, "cancel"), streamlog.key(request_id, "meta"), streamlog.queue_key(model), streamlog.workers_key()]
    token, keep = uuid.uuid4().hex, "keep" if keep_queued else ""
    return retrying(lambda: client.eval(CLAIM, len(keys), *keys, worker_id, time.time(), request_id, model, token, keep))


def reserve(client, request_id, worker_id):
    """A worker prefetched the request: should that worker die, its readers know whom to ask."""
    client.eval(RESERVE, 2, state_key(request_id), streamlog.key(request_id, "meta"), worker_id)


def take_over(client, request_id, observed):
    """Become the one who ends the request, if its state is still `observed` (None: missing).
    Works with the sync or the asyncio client."""
    return client.eval(TAKE_OVER, 2, state_key(request_id), streamlog.key(request_id, "meta"), observed or "", settings.TOKSTREAM_LOG_TTL, time.time())


def holder(state):
    """The worker a "running" state names, else None."""
    return state[len(RUNNING) :] if state and state.startswith(RUNNING) else None


def overdue(state, deadline):
    """Still queued past its deadline: in the broker, or prefetched by a worker busy with others
    (whose beat says nothing of when it will take the request)."""
    return not holder(state) and bool(deadline) and time.time() > float(deadline)


def watcher(state, worker):
    """The worker whose beat a request needs: the one that claimed it, else the one that prefetched it."""
    return holder(state) or worker


@dataclass(frozen=True)
class Facts:
    """What billing a request needs, wherever it is read from."""

    request_id: str
    model: str
    api_key_id: int | None
    user_id: int | None
    received_at: float
    prompt_tokens: int
    n: int = 1

    @classmethod
    def of_task(cls, task):
        return cls(task.request_id, task.model, task.api_key_id, task.user_id, task.received_at, task.prompt_tokens, task.n)

    @classmethod
    def of_pending(cls, row):
        return cls(row.request_id, row.model, row.api_key_id, row.user_id, row.received_at, row.prompt_tokens, row.n)

    @classmethod
    def of_meta(cls, request_id, meta):
        def number(name):
            return int(meta[name]) if meta.get(name) else None

        return cls(
            request_id,
            meta["model"],
            number("api_key_id"),
            number("user_id"),
            float(meta.get("received_at") or time.time()),
            int(meta["prompt_tokens"]),
            int(meta.get("n", 1)),
        )


@dataclass
class Outcome:
    """What the ledger, the end of the log and the metrics all say of one finished request."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str = ""
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    code: str | None = None
    refusal: dict | None = None  # an upstream's refusal, as its client is told it (entries.End)

    def ledger_fields(self, received_at):
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "error": self.error,
            "received_at": ledger.as_datetime(received_at),
            "started_at": ledger.as_datetime(self.started_at),
            "first_token_at": ledger.as_datetime(self.first_token_at),
            "finished_at": ledger.as_datetime(self.finished_at or time.time()),
        }

    def usage(self):
        return usage_of(self.prompt_tokens, self.completion_tokens)


def unrun(verdict, completion_tokens=0, prompt_tokens=0):
    """The outcome of a request ended without (more) generation: cancelled, or failed."""
    if verdict == "cancelled":
        return Outcome(FinishReason.CANCELLED, prompt_tokens, completion_tokens)
    return Outcome(FinishReason.ERROR, prompt_tokens, completion_tokens, error=MESSAGES[verdict], code=CODES[verdict])


def end(client, facts, outcome, finish_reasons=None, gaps=(), **ledger_fields):
    """End the request once: its ledger entry (with the hold back), then its end entry. A
    cancelled request's entry says who cancelled it."""
    reasons = finish_reasons or [outcome.finish_reason] * facts.n
    if outcome.finish_reason == FinishReason.CANCELLED and not outcome.error:
        ledger_fields.setdefault("error", cancelled_by(client, facts.request_id))
    wrote = write_ledger(facts, outcome, **ledger_fields)
    if publish_end(client, facts.request_id, end_entry(reasons, outcome)) or wrote:
        after_end(client, facts, outcome, gaps)  # the first ender only


def write_ledger(facts, outcome, **fields):
    owner = {"api_key_id": facts.api_key_id, "user_id": facts.user_id}
    fields = {"model": facts.model, **owner, **outcome.ledger_fields(facts.received_at), **fields}
    try:
        with transaction.atomic():
            pending = PendingRequest.objects.select_for_update().filter(request_id=facts.request_id).first()
            _, created = ledger.record_once(facts.request_id, outcome.finish_reason, **fields)
            if pending is not None:
                if created:
                    budgets.settle(pending.reservation)
                pending.delete()
            return created
    except Exception:  # the client still gets its end; the operator gets the alarm, the sweeper a retry
        log.critical("no ledger entry could be written for request %s", facts.request_id, exc_info=True)
        return False


def cancelled_by(client, request_id):
    try:
        return streamlog.cancelled_by(client, request_id)
    except Exception:  # Redis away: the entry is written all the same, without the reason
        log.warning("could not read who cancelled %s", request_id, exc_info=True)
        return ""


def end_entry(finish_reasons, outcome):
    """The last log entry: the same counts the ledger entry was given, and each choice's ending."""
    return End(finish_reasons, outcome.usage(), error=outcome.error or None, code=outcome.code or None, refusal=outcome.refusal)


def publish_end(client, request_id, entry):
    """The end entry and the state "ended" in one step, unless another ender was first."""
    keys = [streamlog.key(request_id, "log"), state_key(request_id), streamlog.key(request_id, "meta")]
    try:
        return retrying(lambda: client.eval(FINISH, len(keys), *keys, encode(entry), settings.TOKSTREAM_LOG_MAXLEN, settings.TOKSTREAM_LOG_TTL))
    except Exception:  # its readers end on their own once Redis is back (the state is gone)
        log.error("the end of request %s could not be logged", request_id, exc_info=True)
        return 0


def retrying(call, attempts=5, pause=1.0):
    """`call()`, tried again for a few seconds: a Redis restart must not cost a request its
    claim or its end."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception:
            if attempt == attempts - 1:
                raise
            log.warning("a Redis call failed; trying again", exc_info=True)
            time.sleep(pause)


def after_end(client, facts, outcome, gaps):
    """What may fail without costing the request its end: the queue, the metrics, and whoever
    listens for request_finished (the chat page)."""
    steps = [
        lambda: streamlog.leave_queue(client, facts.model, facts.request_id),
        lambda: record_metrics(client, facts, outcome, gaps),
        lambda: announce(facts, outcome),
    ]
    for step in steps:
        try:
            step()
        except Exception:
            log.warning("after the end of request %s", facts.request_id, exc_info=True)


def announce(facts, outcome):
    answers = request_finished.send_robust(sender=Facts, request_id=facts.request_id, model=facts.model, finish_reason=outcome.finish_reason)
    for receiver, answer in answers:
        if isinstance(answer, Exception):
            log.warning("request_finished receiver %s failed for %s", receiver, facts.request_id, exc_info=answer)


def record_metrics(client, facts, outcome, gaps):
    def since_arrival(moment):
        return None if moment is None else moment - facts.received_at

    timings = {
        "queue_time_seconds": since_arrival(outcome.started_at),
        "time_to_first_token_seconds": since_arrival(outcome.first_token_at),
        "e2e_request_latency_seconds": since_arrival(outcome.finished_at),
    }
    status = str(ledger.STATUS_OF_REASON[outcome.finish_reason])
    metrics.record_request(client, facts.model, status, timings, list(gaps), outcome.prompt_tokens, outcome.completion_tokens)


def usage_in_log(client, request_id):
    """Each choice's count of produced tokens, from its latest delta in the log."""
    produced = {}
    for _, entry in streamlog.read_all(client, request_id):
        if isinstance(entry, Delta):
            produced[entry.i] = entry.n
    return sum(produced.values())


def end_abandoned(client, facts, verdict):
    """End a request that will not run (more) here: billed from its log, the prompt once a
    worker had claimed it (it was being read). Should that worker be alive after all, the
    cancel flag stops it (a relay checks it; an engine checks its claim too)."""
    ran = client.hget(streamlog.key(facts.request_id, "meta"), "ran") == "1"
    outcome = unrun(verdict, usage_in_log(client, facts.request_id), facts.prompt_tokens if ran else 0)
    if ran:
        streamlog.cancel(client, facts.request_id, "ended_elsewhere")
    end(client, facts, outcome, usage_source="stream_log" if ran else "engine_ids")


def end_as_logged(client, facts):
    """A request whose end entry is in its log but whose ledger row was not written (the
    database failed then): the row, from what the end entry says."""
    end = streamlog.end_of(client, facts.request_id)  # the newest entry only, not the whole log
    if end is None:
        return end_abandoned(client, facts, "orphaned")
    usage = end.usage
    outcome = Outcome(worst(end.finish_reasons), usage["prompt_tokens"], usage["completion_tokens"], error=end.error or "")
    write_ledger(facts, outcome, usage_source="stream_log")


# The ledger has one status per request: with n > 1, the worst of its choices' endings.
WORST_FIRST = (FinishReason.ERROR, FinishReason.CANCELLED, FinishReason.LENGTH, FinishReason.TOOL_CALLS, FinishReason.STOP)


def worst(finish_reasons):
    reasons = set(finish_reasons)
    return next((reason for reason in WORST_FIRST if reason in reasons), "error")


def facts_of(client, request_id):
    """A request's facts from its pending row, else from its metadata; None if both are gone."""
    row = PendingRequest.objects.filter(request_id=request_id).first()
    if row is not None:
        return Facts.of_pending(row)
    meta = streamlog.load_meta(client, request_id)
    return Facts.of_meta(request_id, meta) if meta else None


def end_from_reader(request_id, verdict):
    """A reader took the request over (its worker is gone): end it from a web process."""
    close_old_connections()
    try:
        client = streamlog.sync_client()
        facts = facts_of(client, request_id)
        if facts is not None:
            end_abandoned(client, facts, verdict)
    finally:
        close_old_connections()


SWEEP_SECONDS = 10  # how often each worker looks for requests nobody will end (one indexed query)
SWEEP_AFTER = 30  # a pending row this old has its state in Redis, unless Redis lost it (admission writes both at once)


def sweep(client, limit=500):
    """End what nobody else will: requests whose state Redis lost (a restart, with the broker's
    queue), whose worker died with nobody reading, or whose deadline passed."""
    cutoff = timezone.now() - timedelta(seconds=SWEEP_AFTER)
    rows = list(PendingRequest.objects.filter(keyspace=streamlog.keyspace(), created_at__lt=cutoff).order_by("id")[:limit])
    if not rows:
        return 0
    with client.pipeline(transaction=False) as pipe:
        for row in rows:
            pipe.get(state_key(row.request_id)).hmget(streamlog.key(row.request_id, "meta"), "worker", "deadline", "ending_at")
        replies = pipe.execute()
    beats = streamlog.workers(client)
    ended = 0
    for row, state, meta in zip(rows, replies[::2], replies[1::2]):
        verdict = stale(row.model, state, *meta, beats)
        if verdict == ENDED:
            end_as_logged(client, Facts.of_pending(row))
        elif verdict and (state == ENDING or take_over(client, row.request_id, state)):
            end_abandoned(client, Facts.of_pending(row), verdict)
        ended += bool(verdict)
    return ended


def stale(model, state, worker, deadline, ending_at, beats):
    """Why a pending request will not end by itself, or None while it may."""
    if state is None:
        return "lost"
    if state == ENDED:
        return ENDED  # its ledger row failed to be written: write it from its end entry
    if state == ENDING:  # its ender stopped before the ledger had it: end it again
        return "orphaned" if time.time() - float(ending_at or 0) > SWEEP_AFTER else None
    if overdue(state, deadline):
        return "expired"
    if watched_by := watcher(state, worker):
        return None if streamlog.beating(beats, watched_by, model) else "orphaned"
    return None
