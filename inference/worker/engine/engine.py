"""The engine in the shape of vLLM v1's EngineCore: other threads hand it requests, cancels
and steering; step() runs on its own thread.

One step takes the new requests into the scheduler's line, applies cancellations and
steering, asks the scheduler (scheduler.py, which owns the waiting and running queues) for
this step's chunks: room made and the line's head admitted while its prompt fits the KV cache
(kv_manager.py holds every reservation), one token for a decoding request, with prompt-lookup
drafts to verify where they pay, a piece of its prompt for a prefilling one under the budget
of budget.py. It runs one batched forward pass (llama.py), chooses every sequence's token
together (sampling.choose) and moves them to the host in one transfer, and turns each new
token into text and endings (output_processor.py): one Output per request that produced text
or finished.
"""

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from inference import model_files
from inference.protocol.entries import FinishReason
from inference.protocol.payloads import SamplingParams

from . import compiled, formats
from .beam import BeamSearch
from .budget import StepCost
from .detokenizer import IncrementalDetokenizer
from .echo import EchoModel, EchoRunner
from .kv_cache import BLOCK_SIZE, BlockPool
from .kv_manager import KVCacheManager
from .llama import LlamaRunner
from .output_processor import OutputProcessor
from .sampling import NO_TOKEN, adjusted, choose, make_generator, processed
from .scheduler import RequestStatus, Scheduler
from .speculative import Drafter, accepted, verdict_greedy, verdict_sampled

log = logging.getLogger(__name__)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Every token of the sequence in order (prompt, steering, output), and which were generated.
    all_ids: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    computed: int = 0  # tokens of all_ids whose KV is in the cache
    prefilled: int = 0  # prompt and steering tokens the model consumed (from the cache or not)
    cached_tokens: int = 0  # of those, served by the prefix cache
    steered_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    reserved: int = 0  # blocks reserved and not yet allocated
    preemptions: int = 0  # times it gave its blocks back for want of room, to be computed again
    recompute_end: int = 0  # tokens of all_ids computed before it was last preempted
    finish_reason: str | None = None
    error: str | None = None
    arrived_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    detokenizer: IncrementalDetokenizer | None = None
    generator: object = None
    group: str = ""  # the client's request id: cancel and steer reach every choice of it
    index: int = 0  # the choice this sequence is, for n > 1
    leader: "Request | None" = None  # starts once the leader's prompt is cached, to share it
    beam: BeamSearch | None = None
    beam_tables: list[list[int]] = field(default_factory=list)  # one block table per live beam
    pending_steers: list[str] = field(default_factory=list)  # steering it takes at its next step
    prompt_hashes: list[str] | None = None  # of the prompt's full blocks, for the prefix cache
    drafter: Drafter | None = None
    drafted: int = 0  # draft tokens verified
    draft_kept: int = 0  # of those, the ones the model agreed with
    place: object = None  # what its client was last told of its place in line (Output.ahead, or READING)

    def __post_init__(self):
        self.group = self.group or self.request_id

    def pending(self):
        return len(self.all_ids) - self.computed

    def waits_for_leader(self):
        leader = self.leader
        return leader is not None and leader.status is not RequestStatus.FINISHED and not leader.output_ids


def choices(request_id, prompt_ids, params, n=1):
    """The n sequences of one request. Choice 0 prefills the prompt; the others start once its
    blocks are in the prefix cache and compute only the prompt's last partial block. A seed
    gives choice i the seed + i, as vLLM does, so the choices differ yet repeat."""
    if n == 1:
        return [Request(request_id, prompt_ids, params)]
    first = Request(f"{request_id}.0", prompt_ids, params, group=request_id)
    return [first] + [
        Request(
            f"{request_id}.{i}", prompt_ids, replace(params, seed=None if params.seed is None else params.seed + i), group=request_id, index=i, leader=first
        )
        for i in range(1, n)
    ]


@dataclass(frozen=True)
class Totals:
    """What one finished sequence consumed and produced: its bill is made of these."""

    prefilled: int  # prompt and steering tokens the model consumed (from the prefix cache or computed)
    cached_tokens: int  # of those, served by the prefix cache
    steered_tokens: int
    token_ids: list[int]  # every token it produced
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None


@dataclass
class Output:
    """What the engine tells of one sequence after a step; the only thing of the engine its
    callers read (the engine's Requests are its own)."""

    request_id: str
    text: str
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    steered: str | None = None  # steering text that took effect before this output's text
    logprobs: list[dict] = field(default_factory=list)  # one entry per token of this step
    index: int = 0  # the choice
    # Before its first token: how many requests are in line before it, or (reading) that its
    # own prompt is being computed. Only the chat page shows it.
    ahead: int | None = None
    reading: bool = False
    steered_tokens: int = 0  # steering tokens the sequence took so far
    totals: Totals | None = None  # with the finished output


READING = "reading"


def merged(earlier, later):
    """One output for several tokens of one step."""
    if earlier is None:
        return later
    later.text = earlier.text + later.text
    later.logprobs = earlier.logprobs + later.logprobs
    return later


class Engine:
    @classmethod
    def for_model(
        cls, lm, cache_tokens, block_size=BLOCK_SIZE, weights="auto", formats_file=None, kv_dtype="auto", compile=False, compile_cache=None, **options
    ):
        """An engine over a loaded model, with a KV cache of `cache_tokens` tokens in `kv_dtype`
        (`auto`: model_files.kv_dtype), computing with `weights` in that format (`auto`: the one
        measured fastest here within the quality bound, kept in `formats_file`: formats.py);
        with `compile`, every step runs compiled (compiled.py), its artefacts kept in
        `compile_cache`."""
        if isinstance(lm.model, EchoModel):
            runner = EchoRunner(lm.model, cache_tokens, block_size)
        else:
            kv_dtype = getattr(torch, model_files.kv_dtype(kv_dtype, weights, formats.own_format(lm.model)))
            if weights == "auto":
                weights = formats.chosen(lm.model, lm.tokenizer, lm.device, formats_file)
            pool = BlockPool.for_model(lm.model.config, cache_tokens, block_size, kv_dtype, lm.device)
            runner = LlamaRunner(lm.model, pool, lm.device, lm.context_length, weights)
            if compile:
                runner.compiled = compiled.start(runner, compile_cache)
        return cls(runner, lm.tokenizer, lm.stop_ids, lm.context_length, **options)

    def __init__(self, runner, tokenizer, stop_ids, context_length, max_running=8, step_tokens=24, idle_chunk=512, clock=time.time, tells_places=False):
        self.runner = runner
        self.pool = runner.pool
        self.kv = KVCacheManager(runner.pool)
        self.outputs = OutputProcessor(tokenizer, stop_ids, context_length, clock)
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.context_length = context_length
        self.clock = clock
        self.tells_places = tells_places  # outputs that say where a request stands before its first token
        self.stats = Counter()  # computed_prompt_tokens, cached_prompt_tokens, steps, ...
        self.step_cost = StepCost()
        verifies = getattr(runner, "verifies_drafts", False)
        self.scheduler = Scheduler(self.kv, self.step_cost, self.stats, context_length, max_running, step_tokens, idle_chunk, clock, verifies)
        # Handed over by other threads, taken by the engine's at the next step boundary.
        self._arrived = []
        self._cancelled = {}  # request id -> None (the client's cancel) or why it failed
        self._steers = []
        self._lock = threading.Lock()

    # -- called from other threads ------------------------------------------------------

    def add(self, *requests):
        now = self.clock()
        for request in requests:
            request.arrived_at = request.arrived_at or now
        with self._lock:
            self._arrived.extend(requests)

    def cancel(self, request_id, error=None):
        """Takes effect at the next step boundary, for every choice of the request; with an
        `error`, the request ends as failed rather than cancelled."""
        with self._lock:
            self._cancelled.setdefault(request_id, error)

    def steer(self, request_id, text):
        """Inject text into every choice of a running request at the next step boundary."""
        with self._lock:
            self._steers.append((request_id, text))

    # -- called from the engine's thread ---------------------------------------------------

    def live_ids(self):
        """The live requests' ids (the group's, for n > 1)."""
        with self._lock:
            live = [*self.scheduler.requests(), *self._arrived]
        return list(dict.fromkeys(r.group for r in live))

    def has_work(self):
        return bool(self._arrived or self.scheduler.has_work())

    def load(self):
        """(running, waiting): how many sequences decode and how many wait in line."""
        return len(self.scheduler.running), len(self.scheduler.waiting) + len(self._arrived)

    # -- the step -----------------------------------------------------------------------

    def step(self):
        self._take_arrivals()
        outputs = self._apply_cancels() + self._apply_steers()
        plan = self.scheduler.schedule()
        outputs += [self._finish(request, FinishReason.ERROR, error=why) for request, why in plan.failed]
        scheduled = plan.scheduled
        if self.tells_places:
            outputs += self._tell_places(scheduled)
        if scheduled:
            self.stats["steps"] += 1
            try:
                outputs += self._after_step(scheduled, self._forward([chunk for _, chunk in scheduled]))
            except Exception as exc:  # the model failed: end every live request, keep what ended before
                log.exception("engine step failed")
                outputs += self.fail_all(f"generation failed: {exc}")
        self.scheduler.drop_finished()
        return [o for o in outputs if o and (o.text or o.finished or o.steered or o.logprobs or o.error or o.ahead is not None or o.reading)]

    def _tell_places(self, scheduled):
        """Where each request still without a token stands, told when it changes: the requests
        in line before it (running ones whose prompts are being read, then the queue), or that
        its own prompt is being read. A request's later choices follow its first and say nothing."""
        computing = {id(request) for request, _ in scheduled}
        outputs, ahead = [], 0
        for request in self.scheduler.requests():
            if request.index or request.first_token_at is not None or request.beam_tables:
                continue
            running = request.status is RequestStatus.RUNNING
            place = READING if running and (request.place == READING or id(request) in computing) else ahead
            if place != request.place:
                request.place = place
                outputs.append(self._output(request, reading=True) if place == READING else self._output(request, ahead=place))
            ahead += 1
        return outputs

    def _forward(self, chunks):
        start = time.perf_counter()
        logits = self.runner.forward(chunks)
        prompt = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1 and not c.drafted)
        self.step_cost.add(sum(len(c.token_ids) for c in chunks) - prompt, prompt, time.perf_counter() - start)
        return logits

    def fail_all(self, message):
        """The forward pass failed: end every live request rather than hang them."""
        self.scheduler.drop_finished()  # those already ended keep their own ending
        with self._lock:
            arrived, self._arrived = self._arrived, []
        failed = [*self.scheduler.remove_all(), *arrived]
        return [self._finish(r, FinishReason.ERROR, error=message) for r in failed]

    def _take_arrivals(self):
        """New requests join the line, set up to produce text (vLLM's EngineCore.add_request)."""
        with self._lock:
            arrived, self._arrived = self._arrived, []
        for request in arrived:
            self._begin(request)
        self.scheduler.add(arrived)

    def _apply_cancels(self):
        with self._lock:
            cancelled, self._cancelled = self._cancelled, {}
        taken = self.scheduler.remove(cancelled) if cancelled else []
        return [self._end_cancelled(r, cancelled[r.group]) for r in taken]

    def _end_cancelled(self, request, error):
        return self._finish(request, FinishReason.CANCELLED) if error is None else self._finish(request, FinishReason.ERROR, error=error)

    def _apply_steers(self):
        """Each sequence of the steered request takes the text once: now if it runs, or when
        it starts (a choice waiting for its leader, a request waiting for room)."""
        with self._lock:
            steers, self._steers = self._steers, []
        for request_id, text in steers:
            for request in self.scheduler.requests():
                if request.group == request_id and request.status is not RequestStatus.FINISHED:
                    request.pending_steers.append(text)
        outputs = []
        for request in self.scheduler.running:
            texts, request.pending_steers = request.pending_steers, []
            outputs += [self._inject(request, text) for text in texts]
        return outputs

    def _inject(self, request, text):
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        fits = ids and len(request.all_ids) + len(ids) < self.context_length and request.beam is None
        if not fits or not self.kv.reserve_steering(request, len(ids)):
            return self._output(
                request, steered=text, error="steering not applied: it does not fit the context or the KV cache, or the request uses beam search"
            )
        request.all_ids += ids
        request.generated += [False] * len(ids)
        request.steered_tokens += len(ids)
        return self._output(request, steered=text)

    def _begin(self, request):
        """What a new request needs to produce text; its place in the sequence is the scheduler's."""
        self.outputs.start(request)
        request.generator = make_generator(request.params.seed, self.runner.device)
        if request.params.beam_width > 1:
            room = min(request.params.max_tokens, self.context_length - len(request.prompt_ids))
            stops = self.stop_ids | set(request.params.stop_token_ids)
            request.beam = BeamSearch(request.params.beam_width, room, stops)

    def _after_step(self, scheduled, logits):
        """One output per sequence; a beam search's rows go together to its next beam step."""
        outputs, beams, ready, row = [], {}, [], 0
        for request, chunk in scheduled:
            rows = logits[row : row + chunk.logit_rows()]  # [1 or 1 + draft, V]
            row += len(rows)
            if request.beam_tables:
                beams.setdefault(request.request_id, (request, []))[1].append(rows[0])
            elif not self._account(request, chunk):
                continue  # more of the prompt to go
            elif request.beam is not None:  # the prompt is the one parent of the first beams
                request.beam_tables, request.blocks = [request.blocks], []
                outputs.append(self._beam_step(request, rows))
            else:
                ready.append((request, chunk, rows))
        outputs += self._take_tokens(ready)
        return outputs + [self._beam_step(request, torch.stack(rows)) for request, rows in beams.values()]

    def _account(self, request, chunk):
        """Count the chunk's prompt tokens in; -> whether the request now takes a token."""
        end = chunk.start + len(chunk.token_ids) - chunk.drafted
        # Tokens computed again after a preemption were consumed once: they count once.
        consumed = request.generated[max(chunk.start, request.recompute_end) : end].count(False)
        request.prefilled += consumed
        self.stats["computed_prompt_tokens"] += consumed
        request.computed = end
        if request.pending():
            self.kv.register_prompt(request)
            return False
        if not request.output_ids:
            self.kv.register_computed(request)  # the prompt is in: later requests may share it
        return True

    def _take_tokens(self, ready):
        """Every sequence's pick of the step, moved to the host in one transfer."""
        verdicts = [self._verdict(request, chunk, rows) if chunk.drafted else None for request, chunk, rows in ready]
        plain = [i for i, verdict in enumerate(verdicts) if verdict is None]
        for i, pick in zip(plain, self._choose([ready[i] for i in plain])):
            verdicts[i] = pick
        picked = [v.reshape(-1) for v in verdicts if not isinstance(v, Exception)]
        values = torch.cat(picked).tolist() if picked else []
        outputs = []
        for (request, chunk, rows), verdict in zip(ready, verdicts):
            if isinstance(verdict, Exception):
                outputs.append(self._finish(request, FinishReason.ERROR, error=f"generation failed: {verdict}"))
                continue
            mine, values = values[: verdict.numel()], values[verdict.numel() :]
            if mine == [NO_TOKEN]:
                outputs.append(self._finish(request, FinishReason.ERROR, error="generation failed: the model's logits were not numbers"))
                continue
            outputs.append(self._advance(request, chunk, rows, mine))
        return outputs

    def _choose(self, ready):
        """The next tokens of the sequences without drafts, chosen together (sampling.choose);
        only a request with penalties or a logit bias has its row adjusted on its own first."""
        rows = [self._adjusted(request, rows[-1]) for request, _, rows in ready]
        good = [i for i, row in enumerate(rows) if not isinstance(row, Exception)]
        if good:
            requests = [ready[i][0] for i in good]
            logits = torch.stack([rows[i] for i in good]).float()
            picks = choose(logits, [r.params for r in requests], [r.generator for r in requests])
            for slot, i in enumerate(good):
                rows[i] = picks[slot : slot + 1]
        return rows

    def _adjusted(self, request, logits):
        """The logits the request chooses from (or why that failed: it ends alone)."""
        if not processed(request.params):
            return logits
        try:
            return adjusted(logits, request.params, request.all_ids, request.output_ids)
        except Exception as exc:
            log.exception("request %s failed", request.request_id)
            return exc

    def _verdict(self, request, chunk, rows):
        """A draft's verdict as a tensor on the device (or why it failed: that request ends alone)."""
        params, draft = request.params, chunk.draft()
        try:
            if params.greedy:
                return verdict_greedy(rows, params)
            return verdict_sampled(rows, params, draft, request.generator)
        except Exception as exc:
            log.exception("request %s failed", request.request_id)
            return exc

    def _advance(self, request, chunk, rows, verdict):
        draft = chunk.draft()
        tokens = accepted(verdict, draft, request.params.greedy) if draft else verdict
        if draft:
            request.computed += len(tokens) - 1  # the kept draft tokens' keys and values are cached
            request.drafted += len(draft)
            request.draft_kept += len(tokens) - 1
            self.stats["draft_tokens"] += len(draft)
            self.stats["draft_tokens_kept"] += len(tokens) - 1
        output = None
        try:
            for token, logits in zip(tokens, rows):
                output = merged(output, self._next_token(request, logits, token))
                if request.status is RequestStatus.FINISHED:
                    break
        except Exception as exc:  # one request's failure ends that request, not its neighbours
            log.exception("request %s failed", request.request_id)
            return self._finish(request, FinishReason.ERROR, error=f"generation failed: {exc}")
        return output

    def _next_token(self, request, logits, token):
        text, ending = self.outputs.take(request, token)
        output = self._finish(request, ending, text) if ending else self._output(request, text)
        output.logprobs = self.outputs.logprobs(request, logits, token)
        return output

    def _beam_step(self, request, logits):
        try:
            parents = request.beam.advance(logits)
            self.kv.fork(request, parents, len(request.prompt_ids) + len(request.beam.running[0]) - 1 if parents else 0)
        except Exception as exc:
            log.exception("request %s failed", request.request_id)
            return self._finish(request, FinishReason.ERROR, error=f"generation failed: {exc}")
        tokens = request.beam.best() if request.beam.done else request.beam.agreed()
        text = self.outputs.take_agreed(request, tokens)
        if request.beam.done:
            ended = tokens and self.outputs.is_stop_token(request, tokens[-1])
            return self._finish(request, FinishReason.STOP if ended else FinishReason.LENGTH, text)
        return self._output(request, text)

    def _finish(self, request, reason, text="", error=None):
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.error = reason, error
        request.finished_at = self.clock()
        self.kv.free(request)
        text += self.outputs.flush(request)
        return self._output(request, text, finished=True, finish_reason=reason, error=error, totals=totals_of(request))

    @staticmethod
    def _output(request, text="", **fields):
        return Output(request.request_id, text, len(request.output_ids), index=request.index, steered_tokens=request.steered_tokens, **fields)


def totals_of(request):
    return Totals(
        request.prefilled,
        request.cached_tokens,
        request.steered_tokens,
        list(request.output_ids),
        request.started_at,
        request.first_token_at,
        request.finished_at,
    )
