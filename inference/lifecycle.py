"""One request's life, the same whoever ends it.

Admitted: a pending row in the database (with its budget hold) and, in Redis, its metadata,
its log and its state key, "queued". A worker that prefetched it names itself in the metadata,
so readers watch that worker. Claimed by one worker: "running <worker>". Ended once: the ledger
entry, the hold given back and the pending row removed in one transaction; then the end entry
and the state "ended" in one Redis step; then, for the ender that wrote the ledger row only,
the metrics and `request_finished`.

Whether a request is over is one pure function, `verdict`, of one read of Redis (`Seen`) and
the time. Its worker claiming it, a reader whose log went quiet, the relay waiting for an
upstream slot, the cancel endpoint and the sweeper all ask it; each then applies the transition
it decided with `apply`, a Lua script that makes it only if the state is still the one read, so
two askers never both take a request. Whoever ends it goes through `end`, and a second ender
finds the ledger row and the "ended" state and adds nothing.
"""

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from string import Template

from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from billing import budgets, ledger
from inference import metrics, streamlog
from inference.models import PendingRequest
from inference.protocol.entries import Delta, End, FinishReason, Refusal, Usage, encode
from inference.protocol.payloads import META_FIELDS, Admitted, RequestMeta, State, Status
from inference.signals import request_finished

log = logging.getLogger(__name__)


class Claim(StrEnum):
    """What `claim` found, besides a verdict to end the request with."""

    CLAIMED = "claimed"  # this worker runs it
    RUNNING = "running"  # a live worker runs it already: this is a second delivery


class Verdict(StrEnum):
    """Why a request is over, as `verdict` finds it; the end entry's code says the same."""

    LOST = "lost"  # Redis no longer knows it
    ENDED = "ended"  # its end entry is written
    ENDING = "ending"  # someone is ending it: its end entry comes next
    CANCELLED = "cancelled"  # its client left (or pressed stop) before it ran
    EXPIRED = "expired"  # it waited past the deadline admission stored
    ORPHANED = "orphaned"  # the worker that holds it (or its ender) stopped
    UNSERVED = "unserved"  # no live worker takes its model's requests


# Why a request could not run, as its end entry says (and a non-streamed answer's 503).
CODES = {Verdict.EXPIRED: "queue_timeout", Verdict.LOST: "request_lost", Verdict.ORPHANED: "worker_unavailable", Verdict.UNSERVED: "worker_unavailable"}
MESSAGES = {
    Verdict.EXPIRED: "The request waited longer than TOKSTREAM_QUEUE_TIMEOUT for a worker; it was not run.",
    Verdict.LOST: "The request's state was lost (Redis restarted) before it ended.",
    Verdict.ORPHANED: "The worker running the request stopped answering; the request was abandoned.",
    Verdict.UNSERVED: "No worker took the request: the workers of its model stopped or are shutting down; it was not run.",
}
ENDER_GRACE = 30  # seconds an ender may take between taking a request over and its end entry


@dataclass(frozen=True)
class Seen:
    """One read of what decides whether a request is over: its state, its metadata (what
    admission and the workers wrote), its cancel flag and the workers' beats."""

    status: Status | None
    meta: RequestMeta | None = None
    cancelled: bool = False
    beats: dict = field(default_factory=dict)

    @staticmethod
    def read(pipe, request_id):
        """Queue the reads on a pipeline (sync or asyncio); `Seen.of` makes one of their replies."""
        pipe.get(state_key(request_id)).hgetall(streamlog.key(request_id, "meta"))
        pipe.exists(streamlog.key(request_id, "cancel")).hgetall(streamlog.workers_key())

    @classmethod
    def of(cls, replies):
        state, meta, cancelled, beats = replies
        return cls(Status.from_redis(state), RequestMeta.from_redis(meta), bool(cancelled), streamlog.beats_of(beats))

    def ending(self):
        """Someone is ending it (its end entry comes next)."""
        return self.status is not None and self.status.state == State.ENDING


def verdict(seen, model, now, by=None):
    """Why the request is over, or None while it is not: the one rule every reader, the
    sweeper, the relay and the claim apply. `by` is the worker asking of a request it is taking
    or holds without having started it (a claim, a relay waiting for an upstream slot): its own
    claim is no reason to stop, its client leaving and the deadline are."""
    status, meta = seen.status, seen.meta
    if status is None:
        return Verdict.LOST
    if status.state == State.ENDED:
        return Verdict.ENDED
    if status.state == State.ENDING:  # its ender stopped before writing the end: end it again
        return Verdict.ORPHANED if now - ((meta and meta.ending_at) or 0) > ENDER_GRACE else Verdict.ENDING
    held = status.holder()
    if held and held != by:
        return None if streamlog.beating(seen.beats, held, model, now) else Verdict.ORPHANED
    if seen.cancelled:
        return Verdict.CANCELLED
    if meta and now > meta.deadline:
        return Verdict.EXPIRED
    if by is not None:
        return None
    if meta and meta.worker:  # prefetched: a worker busy with others holds it in its memory
        return None if streamlog.beating(seen.beats, meta.worker, model, now) else Verdict.ORPHANED
    return None if model in streamlog.served_models(seen.beats) else Verdict.UNSERVED


def lua(script):
    """A script with the metadata's field names and the states filled in, from their one list."""
    return Template(script).substitute({name: name for name in META_FIELDS}, **{state.name: state.value for state in State})


# Apply the transition a verdict decided, if the state is still the one it was decided on:
# "claimed" makes the request this worker's; any other verdict makes its asker its ender.
APPLY = lua("""
local state = redis.call('GET', KEYS[1]) or ''
if state ~= ARGV[1] then
  -- this very claim, tried again after its reply was lost
  if ARGV[2] == 'claimed' and redis.call('HGET', KEYS[2], '$claim') == ARGV[5] then return 1 end
  return 0
end
if ARGV[2] == 'claimed' then
  redis.call('SET', KEYS[1], '$RUNNING ' .. ARGV[3], 'KEEPTTL')
  redis.call('HSET', KEYS[2], '$worker', ARGV[3], '$claim', ARGV[5], '$ran', '1')
  if ARGV[6] ~= 'keep' then redis.call('ZREM', KEYS[3], ARGV[7]) end
  return 1
end
if state == '' then
  redis.call('SET', KEYS[1], '$ENDING', 'EX', ARGV[8])
else
  redis.call('SET', KEYS[1], '$ENDING', 'KEEPTTL')
  redis.call('HSET', KEYS[2], '$ending_at', ARGV[4])
end
return 1
""")

MARK_PREFETCHED = lua("""
if redis.call('GET', KEYS[1]) == '$QUEUED' then redis.call('HSET', KEYS[2], '$worker', ARGV[1]) end
""")

FINISH = lua("""
if redis.call('GET', KEYS[2]) == '$ENDED' then return 0 end
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'e', ARGV[1])
redis.call('SET', KEYS[2], '$ENDED', 'EX', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[3], ARGV[3])
return 1
""")


def state_key(request_id):
    return streamlog.key(request_id, "state")


def apply(client, request_id, observed, decided, worker_id="", token="", model="", keep=False):
    """Make the transition `decided` (a verdict, or "claimed") if the Status is still `observed`
    (None: missing); 1 if it was made. Works with the sync or the asyncio client."""
    keys = [state_key(request_id), streamlog.key(request_id, "meta"), streamlog.queue_key(model)]
    args = [observed.to_redis() if observed else "", decided, worker_id, time.time(), token, "keep" if keep else "", request_id, settings.TOKSTREAM_LOG_TTL]
    return client.eval(APPLY, len(keys), *keys, *args)


def read(client, request_id):
    with client.pipeline(transaction=False) as pipe:
        Seen.read(pipe, request_id)
        return Seen.of(pipe.execute())


def claim(client, request_id, model, worker_id, keep_queued=False):
    """'claimed' (run it), 'running' (a live worker has it: a duplicate), 'ended', or the
    verdict it must end unrun with (its asker is now its ender). The token tells this claim,
    tried again, from a second delivery. A request that `keep_queued` stays in its model's
    queue (a relayed one, until its upstream has a slot for it)."""
    token = uuid.uuid4().hex
    while (answer := retrying(lambda: claim_once(client, request_id, model, worker_id, token, keep_queued))) is None:
        pass  # its state changed between the read and the transition: decide again
    return answer


def claim_once(client, request_id, model, worker_id, token, keep_queued):
    seen = read(client, request_id)
    if seen.meta is not None and seen.meta.claim == token:
        return Claim.CLAIMED
    if seen.status and seen.status.holder() == worker_id:
        return Claim.RUNNING  # delivered again to the worker that runs it
    found = verdict(seen, model, time.time(), by=worker_id)
    if found in (Verdict.ENDED, Verdict.ENDING):
        return Verdict.ENDED
    if found is None and seen.status.state != State.QUEUED:
        return Claim.RUNNING
    decided = Claim.CLAIMED if found is None else found
    if found == Verdict.LOST or apply(client, request_id, seen.status, decided, worker_id, token, model, keep_queued):
        return decided
    return None


def mark_prefetched(client, request_id, worker_id):
    """A worker prefetched the request: should that worker die, its readers know whom to ask."""
    client.eval(MARK_PREFETCHED, 2, state_key(request_id), streamlog.key(request_id, "meta"), worker_id)


def take_over(client, request_id, observed, decided=Verdict.ORPHANED):
    """Become the one who ends the request, if its Status is still `observed` (None: missing).
    Works with the sync or the asyncio client."""
    return apply(client, request_id, observed, decided)


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
    refusal: Refusal | None = None  # an upstream's refusal, as its client is told it

    def charge(self, admitted, provenance):
        """The request's ledger entry, as this outcome says."""
        at = ledger.as_datetime
        return ledger.Charge(
            admitted.request_id,
            self.finish_reason,
            admitted.model,
            self.prompt_tokens,
            self.completion_tokens,
            received_at=at(admitted.received_at),
            finished_at=at(self.finished_at or time.time()),
            api_key_id=admitted.api_key_id,
            user_id=admitted.user_id,
            error=self.error,
            started_at=at(self.started_at),
            first_token_at=at(self.first_token_at),
            provenance=provenance,
        )

    def usage(self):
        return Usage(self.prompt_tokens, self.completion_tokens)


def unrun(verdict, completion_tokens=0, prompt_tokens=0):
    """The outcome of a request ended without (more) generation: cancelled, or failed."""
    if verdict == Verdict.CANCELLED:
        return Outcome(FinishReason.CANCELLED, prompt_tokens, completion_tokens)
    return Outcome(FinishReason.ERROR, prompt_tokens, completion_tokens, error=MESSAGES[verdict], code=CODES[verdict])


def end(client, admitted, outcome, finish_reasons=None, gaps=(), provenance=None):
    """End the request once: its ledger entry (with the hold back), then its end entry. What
    follows a ledger row (the metrics, request_finished) follows only the ender that wrote it. A
    cancelled request's entry says who cancelled it (its client is told no error)."""
    reasons = finish_reasons or [outcome.finish_reason] * admitted.n
    why = outcome.error
    if outcome.finish_reason == FinishReason.CANCELLED and not why:
        why = cancelled_by(client, admitted.request_id)
    wrote = write_ledger(admitted, dataclasses.replace(outcome, error=why), provenance or ledger.Provenance())
    publish_end(client, admitted.request_id, end_entry(reasons, outcome))
    if wrote:
        after_end(client, admitted, outcome, gaps)


def write_ledger(admitted, outcome, provenance):
    try:
        with transaction.atomic():
            pending = PendingRequest.objects.select_for_update().filter(request_id=admitted.request_id).first()
            _, created = ledger.record_once(outcome.charge(admitted, provenance))
            if pending is not None:
                if created:
                    budgets.release(budgets.Hold.from_json(pending.hold))
                pending.delete()
            return created
    except Exception:  # the client still gets its end; the operator gets the alarm, the sweeper a retry
        log.critical("no ledger entry could be written for request %s", admitted.request_id, exc_info=True)
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


def after_end(client, admitted, outcome, gaps):
    """What may fail without costing the request its end: the queue, the metrics, and whoever
    listens for request_finished (the chat page)."""
    steps = [
        lambda: streamlog.leave_queue(client, admitted.model, admitted.request_id),
        lambda: record_metrics(client, admitted, outcome, gaps),
        lambda: announce(admitted, outcome),
    ]
    for step in steps:
        try:
            step()
        except Exception:
            log.warning("after the end of request %s", admitted.request_id, exc_info=True)


def announce(admitted, outcome):
    answers = request_finished.send_robust(sender=Admitted, request_id=admitted.request_id, model=admitted.model, finish_reason=outcome.finish_reason)
    for receiver, answer in answers:
        if isinstance(answer, Exception):
            log.warning("request_finished receiver %s failed for %s", receiver, admitted.request_id, exc_info=answer)


def record_metrics(client, admitted, outcome, gaps):
    def since_arrival(moment):
        return None if moment is None else moment - admitted.received_at

    timings = {
        "queue_time_seconds": since_arrival(outcome.started_at),
        "time_to_first_token_seconds": since_arrival(outcome.first_token_at),
        "e2e_request_latency_seconds": since_arrival(outcome.finished_at),
    }
    status = str(ledger.STATUS_OF_REASON[outcome.finish_reason])
    metrics.record_request(client, admitted.model, status, timings, list(gaps), outcome.prompt_tokens, outcome.completion_tokens)


def usage_in_log(client, request_id):
    """Each choice's count of produced tokens, from its latest delta in the log."""
    produced = {}
    for _, entry in streamlog.read_all(client, request_id):
        if isinstance(entry, Delta):
            produced[entry.i] = entry.completion_tokens
    return sum(produced.values())


def end_abandoned(client, admitted, verdict):
    """End a request that will not run (more) here: billed from its log, the prompt once a
    worker had claimed it (it was being read). Should that worker be alive after all, the
    cancel flag stops it (a relay checks it; an engine checks its claim too)."""
    meta = streamlog.load_meta(client, admitted.request_id)
    ran = meta is not None and meta.ran
    outcome = unrun(verdict, usage_in_log(client, admitted.request_id), admitted.prompt_tokens if ran else 0)
    if ran:
        streamlog.cancel(client, admitted.request_id, "ended_elsewhere")
    end(client, admitted, outcome, provenance=ledger.Provenance(usage_source="stream_log" if ran else "engine_ids"))


def end_as_logged(client, admitted):
    """A request whose end entry is in its log but whose ledger row was not written (the
    database failed then): the row, from what the end entry says."""
    end = streamlog.end_of(client, admitted.request_id)  # the newest entry only, not the whole log
    if end is None:
        return end_abandoned(client, admitted, Verdict.ORPHANED)
    outcome = Outcome(worst(end.finish_reasons), end.usage.prompt_tokens, end.usage.completion_tokens, error=end.error or "")
    if write_ledger(admitted, outcome, ledger.Provenance(usage_source="stream_log")):
        after_end(client, admitted, outcome, ())


# The ledger has one status per request: with n > 1, the worst of its choices' endings.
WORST_FIRST = (FinishReason.ERROR, FinishReason.CANCELLED, FinishReason.LENGTH, FinishReason.TOOL_CALLS, FinishReason.STOP)


def worst(finish_reasons):
    reasons = set(finish_reasons)
    return next((reason for reason in WORST_FIRST if reason in reasons), "error")


def admitted_of(client, request_id):
    """The admitted request, from its pending row, else from its metadata; None if both are gone."""
    row = PendingRequest.objects.filter(request_id=request_id).first()
    if row is not None:
        return row.admitted()
    meta = streamlog.load_meta(client, request_id)
    return meta.admitted(request_id) if meta else None


def end_from_reader(request_id, verdict):
    """A reader took the request over (its worker is gone): end it from a web process."""
    close_old_connections()
    try:
        client = streamlog.sync_client()
        admitted = admitted_of(client, request_id)
        if admitted is not None:
            end_abandoned(client, admitted, verdict)
    finally:
        close_old_connections()


SWEEP_SECONDS = 10  # how often each worker looks for requests nobody will end (one indexed query)
SWEEP_AFTER = 30  # a pending row this old has its state in Redis, unless Redis lost it (admission writes both at once)


def sweep(client, limit=500):
    """End what nobody else will: requests whose state Redis lost (a restart, with the broker's
    queue), whose worker died with nobody reading, whose deadline passed, or whose ledger row
    failed after their end entry. A queued request of a model no worker serves is left to its
    readers and its deadline: the worker may be restarting (it does not beat while it loads)."""
    cutoff = timezone.now() - timedelta(seconds=SWEEP_AFTER)
    rows = list(PendingRequest.objects.filter(keyspace=streamlog.keyspace(), created_at__lt=cutoff).order_by("id")[:limit])
    if not rows:
        return 0
    with client.pipeline(transaction=False) as pipe:
        for row in rows:
            Seen.read(pipe, row.request_id)
        replies = pipe.execute()
    ended = 0
    for index, row in enumerate(rows):
        seen = Seen.of(replies[4 * index : 4 * index + 4])
        found = verdict(seen, row.model, time.time())
        if found == Verdict.ENDED:
            end_as_logged(client, row.admitted())
        elif found in (Verdict.ENDING, Verdict.UNSERVED, None):
            continue
        elif seen.ending() or take_over(client, row.request_id, seen.status, found):
            end_abandoned(client, row.admitted(), found)
        ended += 1
    return ended


def end_if_over(client, request_id, model):
    """End the request here if it is over and nobody else is ending it (the cancel endpoint:
    a request stopped while it queued ends at once, not when a worker reaches it)."""
    seen = read(client, request_id)
    found = verdict(seen, model, time.time())
    if found in (Verdict.CANCELLED, Verdict.EXPIRED, Verdict.ORPHANED) and take_over(client, request_id, seen.status, found):
        admitted = admitted_of(client, request_id)
        if admitted is not None:
            end_abandoned(client, admitted, found)
        return True
    return False
