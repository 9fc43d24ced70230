"""The engine in the shape of vLLM v1: a waiting queue, a running set, and step().

One step applies cancellations and steering, admits waiting requests whose worst case fits
the KV cache, schedules one chunk per running request (one token for a decoding request, a
piece of its prompt for a prefilling one, under a per-step token budget), runs one batched
forward pass, samples, and emits one Output per request that produced text or finished.
"""

import logging
import math
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from inference.protocol.entries import FinishReason

from .beam import BeamSearch
from .detokenizer import IncrementalDetokenizer
from .echo import EchoModel, EchoRunner
from .kv_cache import BLOCK_SIZE, BlockPool, block_hashes
from .logprobs import logprobs_of
from .runner import BatchRunner, Chunk
from .sampling import SamplingParams, make_generator, sample

log = logging.getLogger(__name__)
MIN_PREFILL_TOKENS = 16  # a step's prefill share however many decode: waiting prompts still advance
# A bigger batch's step costs more, so it carries more prefill for the same relative slowdown.
PREFILL_PER_DECODE = 2


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    finish_reason: str | None = None
    error: str | None = None
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


@dataclass
class Output:
    request_id: str
    text: str
    completion_tokens: int
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    steered: str | None = None  # steering text that took effect before this output's text
    logprobs: list[dict] = field(default_factory=list)  # one entry per token of this step
    index: int = 0  # the choice


class Engine:
    @classmethod
    def for_model(cls, lm, cache_tokens, block_size=BLOCK_SIZE, **options):
        """An engine over a loaded model, with a KV cache of `cache_tokens` tokens."""
        if isinstance(lm.model, EchoModel):
            runner = EchoRunner(lm.model, cache_tokens, block_size)
        else:
            runner = BatchRunner(lm.model, BlockPool.for_model(lm.model.config, cache_tokens, block_size, lm.model.dtype, lm.device), lm.device)
        return cls(runner, lm.tokenizer, lm.stop_ids, lm.context_length, **options)

    def __init__(self, runner, tokenizer, stop_ids, context_length, max_running=8, step_tokens=24, idle_chunk=512, clock=time.time):
        self.runner = runner
        self.pool = runner.pool
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.context_length = context_length
        self.max_running = max_running
        self.step_tokens = step_tokens  # tokens per step while others decode: their gap stays short
        self.idle_chunk = idle_chunk  # prefill chunk when nobody waits on this step
        self.clock = clock
        self.waiting = deque()
        self.running = []
        self.stats = Counter()  # computed_prompt_tokens, cached_prompt_tokens, steps, ...
        self._cancelled = {}  # request id -> None (the client's cancel) or why it failed
        self._steers = []
        self._lock = threading.Lock()

    # -- called from other threads ------------------------------------------------------

    def add(self, *requests):
        with self._lock:
            self.waiting.extend(requests)

    def cancel(self, request_id, error=None):
        """Takes effect at the next step boundary, for every choice of the request; with an
        `error`, the request ends as failed rather than cancelled."""
        with self._lock:
            self._cancelled.setdefault(request_id, error)

    def steer(self, request_id, text):
        """Inject text into every choice of a running request at the next step boundary."""
        with self._lock:
            self._steers.append((request_id, text))

    def live_ids(self):
        """The live requests' ids (the group's, for n > 1)."""
        with self._lock:
            return list(dict.fromkeys(r.group for r in (*self.waiting, *self.running)))

    def has_work(self):
        return bool(self.waiting or self.running)

    # -- the step -----------------------------------------------------------------------

    def step(self):
        outputs = self._apply_cancels()
        self._drop_finished()
        outputs += self._apply_steers() + self._admit()
        scheduled = self._schedule()
        if scheduled:
            self.stats["steps"] += 1
            try:
                outputs += self._after_step(scheduled, self.runner.forward([chunk for _, chunk in scheduled]))
            except Exception as exc:  # the model failed: end every live request, keep what ended before
                log.exception("engine step failed")
                outputs += self.fail_all(f"generation failed: {exc}")
        self._drop_finished()
        return [o for o in outputs if o and (o.text or o.finished or o.steered or o.logprobs or o.error)]

    def _drop_finished(self):
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]

    def fail_all(self, message):
        """The forward pass failed: end every live request rather than hang them."""
        self._drop_finished()  # those already ended keep their own ending
        with self._lock:
            failed, self.waiting = [*self.running, *self.waiting], deque()
        self.running = []
        return [self._finish(r, FinishReason.ERROR, error=message) for r in failed]

    def _apply_cancels(self):
        with self._lock:
            cancelled, self._cancelled = self._cancelled, {}
            waiting = [r for r in self.waiting if r.group in cancelled]
            self.waiting = deque(r for r in self.waiting if r.group not in cancelled)
        running = [r for r in self.running if r.group in cancelled]
        return [self._end_cancelled(r, cancelled[r.group]) for r in (*waiting, *running)]

    def _end_cancelled(self, request, error):
        return self._finish(request, FinishReason.CANCELLED) if error is None else self._finish(request, FinishReason.ERROR, error=error)

    def _apply_steers(self):
        """Each sequence of the steered request takes the text once: now if it runs, or when
        it starts (a choice waiting for its leader, a request waiting for room)."""
        with self._lock:
            steers, self._steers = self._steers, []
            for request_id, text in steers:
                for request in (*self.waiting, *self.running):
                    if request.group == request_id and request.status is not RequestStatus.FINISHED:
                        request.pending_steers.append(text)
        outputs = []
        for request in self.running:
            texts, request.pending_steers = request.pending_steers, []
            outputs += [self._inject(request, text) for text in texts]
        return outputs

    def _inject(self, request, text):
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        blocks = math.ceil(len(ids) / self.pool.block_size) + 1  # +1: they may straddle a block
        fits = ids and len(request.all_ids) + len(ids) < self.context_length and request.beam is None
        if not fits or not self.pool.reserve(blocks):
            return self._output(
                request, steered=text, error="steering not applied: it does not fit the context or the KV cache, or the request uses beam search"
            )
        request.reserved += blocks
        request.all_ids += ids
        request.generated += [False] * len(ids)
        request.steered_tokens += len(ids)
        return self._output(request, steered=text)

    def _admit(self):
        """Start waiting requests, first come first served; returns those that can never fit."""
        refused = []
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            problem = self._never_fits(request)
            if not problem and (request.waits_for_leader() or not self._reserve(request)):
                break  # the head waits: for its worst case to fit, or for its leader's prompt
            with self._lock:
                self.waiting.popleft()
            if problem:
                refused.append(self._finish(request, FinishReason.ERROR, error=problem))
            else:
                self._start(request)
        return refused

    def _never_fits(self, request):
        if not request.prompt_ids:
            return "the prompt is empty"
        if len(request.prompt_ids) >= self.context_length:
            return "the prompt fills the whole context"
        if self._worst_case(request) > self.pool.num_blocks:
            return "the request is larger than the whole KV cache"
        return None

    def _worst_case(self, request):
        """Blocks for the prompt and every token it may produce: reserved up front, so a
        running request never runs out of cache and nothing is ever truncated. Beams share
        the prompt's full blocks and hold the rest each."""
        prompt, width = len(request.prompt_ids), request.params.beam_width
        blocks = math.ceil((prompt + request.params.max_tokens) / self.pool.block_size)
        shared = prompt // self.pool.block_size if width > 1 else 0
        return shared + max(width, 1) * (blocks - shared)

    def _reserve(self, request):
        """Reuse cached prefix blocks, then reserve the rest of the worst case."""
        prompt, worst = request.prompt_ids, self._worst_case(request)
        # The last prompt token is always computed: its logits give the first output token.
        if request.prompt_hashes is None:  # once: a head that waits for room asks every step
            request.prompt_hashes = block_hashes(prompt[:-1], self.pool.block_size)
        cached = self.pool.lookup(request.prompt_hashes)
        if not self.pool.reserve(worst - len(cached)):
            self.pool.release(cached)
            return False
        # Take the whole worst case now: in one go, its blocks are neighbours in memory.
        # Beams fork as they go: they take the prompt's blocks and keep the rest reserved.
        now = math.ceil(len(prompt) / self.pool.block_size) if request.params.beam_width > 1 else worst
        request.blocks = cached + [self.pool.allocate() for _ in range(now - len(cached))]
        request.reserved = worst - now
        request.computed = request.cached_tokens = request.prefilled = len(cached) * self.pool.block_size
        self.stats["cached_prompt_tokens"] += request.cached_tokens
        return True

    def _start(self, request):
        request.status = RequestStatus.RUNNING
        request.started_at = self.clock()
        request.all_ids = list(request.prompt_ids)
        request.generated = [False] * len(request.prompt_ids)
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.params.stop)
        request.generator = make_generator(request.params.seed, self.runner.device)
        if request.params.beam_width > 1:
            room = min(request.params.max_tokens, self.context_length - len(request.prompt_ids))
            stops = self.stop_ids | set(request.params.stop_token_ids)
            request.beam = BeamSearch(request.params.beam_width, room, stops)
        self.running.append(request)

    def _schedule(self):
        beaming = [r for r in self.running if r.beam_tables]
        decoding = [r for r in self.running if not r.beam_tables and r.pending() == 1]
        prefilling = [r for r in self.running if not r.beam_tables and r.pending() > 1]
        scheduled = [(r, self._chunk(r, 1)) for r in decoding] + [pair for r in beaming for pair in self._beam_chunks(r)]
        busy = len(scheduled)
        budget = max(self.step_tokens - busy, MIN_PREFILL_TOKENS, PREFILL_PER_DECODE * busy) if busy else self.idle_chunk
        for request in prefilling:
            if budget <= 0:
                break
            size = min(request.pending(), budget)
            scheduled.append((request, self._chunk(request, size)))
            budget -= size
        return scheduled

    def _chunk(self, request, size):
        start = request.computed
        self._grow(request, request.blocks, start + size)
        return Chunk(request.all_ids[start : start + size], start, request.blocks, request.request_id)

    def _grow(self, request, table, end):
        """Blocks from the request's reservation until the table covers `end` tokens."""
        while len(table) * self.pool.block_size < end:
            table.append(self.pool.allocate())
            request.reserved -= 1

    def _beam_chunks(self, request):
        """Each live beam's newest token, whose KV this step computes."""
        start = len(request.prompt_ids) + len(request.beam.running[0]) - 1
        for table in request.beam_tables:
            self._grow(request, table, start + 1)
        return [(request, Chunk([tokens[-1]], start, table, request.request_id)) for tokens, table in zip(request.beam.running, request.beam_tables)]

    def _after_step(self, scheduled, logits):
        """One output per sequence; a beam search's rows go together to its next beam step."""
        outputs, beams = [], {}
        for (request, chunk), row in zip(scheduled, logits):
            if request.beam_tables:
                beams.setdefault(request.request_id, (request, []))[1].append(row)
            else:
                outputs.append(self._after_forward(request, chunk, row))
        return outputs + [self._beam_step(request, torch.stack(rows)) for request, rows in beams.values()]

    def _after_forward(self, request, chunk, logits):
        end = chunk.start + len(chunk.token_ids)
        consumed = request.generated[chunk.start : end].count(False)
        request.prefilled += consumed
        self.stats["computed_prompt_tokens"] += consumed
        request.computed = end
        if request.pending():
            return None  # more of the prompt to go
        if not request.output_ids:
            self._register_computed(request)  # the prompt is in: later requests may share it
        if request.beam is not None:  # the prompt is the one parent of the first beams
            request.beam_tables, request.blocks = [request.blocks], []
            return self._beam_step(request, logits[None])
        try:
            return self._next_token(request, logits)
        except Exception as exc:  # one request's failure ends that request, not its neighbours
            log.exception("request %s failed", request.request_id)
            return self._finish(request, FinishReason.ERROR, error=f"generation failed: {exc}")

    def _next_token(self, request, logits):
        token = sample(logits, request.params, request.generator, request.all_ids, request.output_ids)
        request.output_ids.append(token)
        request.all_ids.append(token)
        request.generated.append(True)
        if request.first_token_at is None:
            request.first_token_at = self.clock()
        output = self._update(request, token)
        if request.params.logprobs and not self._is_stop_token(request, token):  # as OpenAI: no entry for the end
            output.logprobs = [logprobs_of(self.tokenizer, logits, token, request.params.top_logprobs)]
        return output

    def _is_stop_token(self, request, token):
        return token in self.stop_ids or token in request.params.stop_token_ids

    def _update(self, request, token):
        if self._is_stop_token(request, token):
            return self._finish(request, FinishReason.STOP)
        text = request.detokenizer.add(token)
        if request.detokenizer.stopped:
            return self._finish(request, FinishReason.STOP, text)
        if self._out_of_room(request):
            return self._finish(request, FinishReason.LENGTH, text)
        return self._output(request, text)

    def _beam_step(self, request, logits):
        try:
            self._fork(request, request.beam.advance(logits))
        except Exception as exc:
            log.exception("request %s failed", request.request_id)
            return self._finish(request, FinishReason.ERROR, error=f"generation failed: {exc}")
        tokens = request.beam.best() if request.beam.done else request.beam.agreed()
        text = self._release_tokens(request, tokens)
        if request.beam.done:
            ended = tokens and self._is_stop_token(request, tokens[-1])
            return self._finish(request, FinishReason.STOP if ended else FinishReason.LENGTH, text)
        return self._output(request, text)

    def _fork(self, request, parents):
        """Each new beam takes its parent's block table: full blocks shared, and the last,
        partial one copied for every child of a parent but the first (copy on write)."""
        old, tables = request.beam_tables, [list(request.beam_tables[p]) for p in parents]
        for table in tables:
            self.pool.share(table)
        for table in old:
            self.pool.release(table)
        request.beam_tables = tables
        if tables:  # none left: the search is over, and _free gives the reservation back
            self._settle_reservation(request)
        computed = len(request.prompt_ids) + len(request.beam.running[0]) - 1 if tables else 0
        if computed % self.pool.block_size:
            last, taken = computed // self.pool.block_size, set()
            for table in tables:
                if table[last] in taken:
                    table[last] = self._copy_block(request, table[last])
                taken.add(table[last])

    def _settle_reservation(self, request):
        """Reserve again what the beams just gave back, so the worst case stays covered."""
        held = len({block for table in request.beam_tables for block in table})
        missing = self._worst_case(request) - held - request.reserved
        if missing > 0 and not self.pool.reserve(missing):
            raise RuntimeError("a beam's reservation was not honoured")
        if missing < 0:
            self.pool.unreserve(-missing)
        request.reserved += missing

    def _copy_block(self, request, source):
        target = self.pool.allocate()
        request.reserved -= 1
        self.pool.copy(source, target)
        self.pool.release([source])
        return target

    def _release_tokens(self, request, tokens):
        """Stream the tokens agreed on since the last step (a prefix no beam will take back)."""
        new = tokens[len(request.output_ids) :]
        request.output_ids = list(tokens)
        if new and request.first_token_at is None:
            request.first_token_at = self.clock()
        return "".join(request.detokenizer.add(t) for t in new if not self._is_stop_token(request, t))

    def _out_of_room(self, request):
        return len(request.output_ids) >= request.params.max_tokens or len(request.all_ids) >= self.context_length

    def _finish(self, request, reason, text="", error=None):
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.error = reason, error
        request.finished_at = self.clock()
        self._free(request)
        if request.detokenizer is not None:
            text += request.detokenizer.flush()
        return self._output(request, text, finished=True, finish_reason=reason, error=error)

    @staticmethod
    def _output(request, text="", **fields):
        return Output(request.request_id, text, len(request.output_ids), index=request.index, **fields)

    def _register_computed(self, request):
        computed = request.all_ids[: request.computed]
        pairs = list(zip(request.blocks, block_hashes(computed, self.pool.block_size)))
        for block, digest in reversed(pairs):  # a chain's head is the last to be evicted
            self.pool.register(block, digest)

    def _free(self, request):
        """Give the blocks back, keeping the full computed ones for later prompts."""
        self._register_computed(request)
        for table in (request.blocks, *request.beam_tables):
            self.pool.release(table)
        self.pool.unreserve(request.reserved)
        request.blocks, request.beam_tables, request.reserved = [], [], 0
