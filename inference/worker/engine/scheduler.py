"""The engine's two queues and what each step computes of them, in the shape of vLLM v1's scheduler.

Requests wait in line, first come first served, until their prompt fits the KV cache
(kv_manager.py holds every reservation) and a running slot is free; a running request that
the cache cannot grow preempts the one that started last, which goes back to the head of the
line to be computed again. Each step, a decoding request gets its next token, with
prompt-lookup drafts to verify where the tokens it is likely to keep pay for the longer step;
each live beam its newest token; prefilling requests pieces of their prompts, first come
first served, under the budget of budget.py. The scheduler runs on the engine's thread only.
"""

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from .budget import prefill_budget
from .runner import Chunk
from .speculative import Drafter

DRAFT_LENGTH = 4  # draft tokens per sequence and step
# Draft tokens a step may verify, less one per decoding sequence: while a step's matrix products
# are bound by reading the weights, a few more tokens cost little; in a big batch they would not.
DRAFT_TOKENS = 8


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Plan:
    """One step's schedule: the (request, chunk) pairs to compute, and the requests taken off
    both queues because they cannot go on, each with why (the engine ends them as failed)."""

    scheduled: list = field(default_factory=list)
    failed: list = field(default_factory=list)


class Scheduler:
    def __init__(self, kv, step_cost, stats, context_length, max_running, step_tokens, idle_chunk, clock, verifies_drafts):
        self.kv = kv  # the engine's KV-cache manager: a chunk grows its request's blocks
        self.step_cost = step_cost  # the engine's measured step times
        self.stats = stats  # the engine's counters: preemptions, cached_prompt_tokens
        self.context_length = context_length
        self.max_running = max_running
        self.step_tokens = step_tokens  # tokens per step while others decode: their gap stays short
        self.idle_chunk = idle_chunk  # prefill chunk when nobody waits on this step
        self.clock = clock
        self.verifies_drafts = verifies_drafts  # the runner can score drafts in one pass
        self.waiting = deque()
        self.running = []

    # -- the queues -----------------------------------------------------------------------

    def add(self, requests):
        self.waiting.extend(requests)

    def requests(self):
        """Every live request, running ones first, then the line in order."""
        return [*self.running, *self.waiting]

    def has_work(self):
        return bool(self.waiting or self.running)

    def remove(self, groups):
        """Take every request of these groups off both queues; -> them, waiting ones first."""
        taken = [r for r in (*self.waiting, *self.running) if r.group in groups]
        self.waiting = deque(r for r in self.waiting if r.group not in groups)
        self.running = [r for r in self.running if r.group not in groups]
        return taken

    def remove_all(self):
        taken, self.running, self.waiting = self.requests(), [], deque()
        return taken

    def drop_finished(self):
        self.running = [r for r in self.running if r.status is not RequestStatus.FINISHED]

    # -- one step -------------------------------------------------------------------------

    def schedule(self):
        """Room for the running requests, then the line's head admitted while it fits, then
        this step's chunks."""
        self.drop_finished()
        plan = Plan(failed=self.make_room())
        plan.failed += self.start_waiting()
        plan.scheduled = self.chunks()
        return plan

    def make_room(self):
        """Blocks for every running sequence's next step, drafts included. Where the cache has
        none left, the request that started last gives its blocks back and waits at the head
        of the line to be computed again (vLLM's preemption by recompute): its keys and values
        come out the same (one numeric path), so its reply does not change; only its time does.
        A request that would have to preempt itself while alone fails rather than spin."""
        failed = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.beam is not None:  # preempted, or a beam search (its worst case is held)
                continue
            while not self.kv.top_up(request, self.next_step_tokens(request)):
                victim = next(r for r in reversed(self.running) if r.beam is None)
                if victim is request and len(self.running) == 1:
                    self.running.remove(request)
                    self.kv.free(request)  # now: the line's head may take its blocks this step
                    failed.append((request, "the KV cache ran out: raise TOKSTREAM_KV_CACHE_MB"))
                    break
                self.preempt(victim)
                if victim is request:
                    break
        return failed

    def next_step_tokens(self, request):
        """Tokens the sequence holds after its next step: its pending ones and, once it decodes,
        room for drafts (never beyond its worst case)."""
        if request.pending() > 1:
            return len(request.all_ids)
        limit = len(request.all_ids) - len(request.output_ids) + request.params.max_tokens
        return min(len(request.all_ids) + DRAFT_LENGTH, limit, self.context_length)

    def preempt(self, request):
        self.kv.free(request)  # its full computed blocks stay in the prefix cache: the recompute may find them
        request.recompute_end = max(request.recompute_end, request.computed)
        request.computed = 0
        request.status = RequestStatus.WAITING
        request.preemptions += 1
        self.stats["preemptions"] += 1
        self.running.remove(request)
        self.waiting.appendleft(request)

    def start_waiting(self):
        """Start waiting requests, first come first served; -> those that can never fit, with why."""
        refused = []
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            problem = self.never_fits(request)
            if not problem and (request.waits_for_leader() or self.shares_a_prefix_in_progress(request) or not self.reserve(request)):
                break  # the head waits: for room, for its leader's prompt, or for a prefix another is computing
            self.waiting.popleft()
            if problem:
                refused.append((request, problem))
            else:
                self.start(request)
        return refused

    def shares_a_prefix_in_progress(self, request):
        """The next block of the prompt that the cache lacks is one a running request is
        computing now: computed once and shared (kv_manager.register_prompt), it costs the
        waiting request a step or a few, and saves computing it again."""
        if request.all_ids:  # preempted: its sequence is more than the prompt
            return False
        computing = {digest for running in self.running for digest in self.kv.computing(running)}
        return bool(computing) and self.kv.first_uncached(request) in computing

    def never_fits(self, request):
        if not request.prompt_ids:
            return "the prompt is empty"
        if len(request.prompt_ids) >= self.context_length:
            return "the prompt fills the whole context"
        if self.kv.never_fits(request):
            return "the request is larger than the whole KV cache"
        return None

    def reserve(self, request):
        """Blocks for the request now, leaving a block for each running sequence to grow into."""
        if not self.kv.reserve(request, headroom=len(self.running)):
            return False
        if not request.preemptions:
            request.cached_tokens = request.prefilled = request.computed
            self.stats["cached_prompt_tokens"] += request.cached_tokens
        return True

    def start(self, request):
        request.status = RequestStatus.RUNNING
        if not request.preemptions:  # a preempted one keeps its sequence and its text so far
            request.started_at = self.clock()
            request.all_ids = list(request.prompt_ids)
            request.generated = [False] * len(request.prompt_ids)
        self.running.append(request)

    def chunks(self):
        """This step's (request, chunk) pairs."""
        running = self.running
        beaming = [r for r in running if r.beam_tables]
        decoding = [r for r in running if not r.beam_tables and r.pending() == 1]
        prefilling = [r for r in running if not r.beam_tables and r.pending() > 1]
        scheduled, drafts = [], DRAFT_TOKENS - len(decoding)
        for request in decoding:
            draft = self.draft(request, drafts, len(decoding))
            drafts -= len(draft)
            scheduled.append((request, self.chunk(request, 1, draft)))
        scheduled += [pair for r in beaming for pair in self.beam_chunks(r)]
        budget, pieces = self.budget_for(len(scheduled), prefilling), []
        for request in prefilling:
            if budget <= 0:
                break
            size = min(request.pending(), budget)
            pieces.append((request, self.chunk(request, size)))
            budget -= size
        return scheduled + pieces

    def budget_for(self, decoding, prefilling):
        first = [r for r in prefilling if not r.output_ids]  # still waiting for a first token
        return prefill_budget(decoding, len(first), sum(r.pending() for r in first), self.step_cost, self.step_tokens, self.idle_chunk)

    def chunk(self, request, size, draft=()):
        start = request.computed
        tokens = request.all_ids[start : start + size] + list(draft)
        self.kv.grow(request, request.blocks, start + len(tokens))
        return Chunk(tokens, start, request.blocks, request.request_id, drafted=len(draft))

    def draft(self, request, budget, decoding):
        """Draft tokens to verify with the request's next token, within its reservation, when
        the tokens it is likely to keep are worth the longer step."""
        if budget <= 0 or not request.output_ids or not self.speculates(request):
            return []  # a prompt's last token: the reply has nothing yet to look up
        left = request.params.max_tokens - len(request.output_ids) - 1  # the model's own token comes on top
        room = min(left, self.kv.room(request), self.context_length - len(request.all_ids) - 1)
        if room <= 0:
            return []
        request.drafter = request.drafter or Drafter()
        draft = request.drafter.propose(request.all_ids, min(DRAFT_LENGTH, budget, room))
        return draft if draft and self.drafts_pay(request, decoding, len(draft)) else []

    def drafts_pay(self, request, decoding, size):
        """Tokens expected to be kept (from the request's own record, starting from one in
        two) against how much longer the step gets, both from what was measured here. A
        request's first draft is verified whatever the estimate: it starts the request's record,
        and it keeps the steps with drafts measured, so an estimate made in a bad moment (while
        no step had drafts to correct it) cannot keep drafts off for good."""
        if not request.drafted:
            return True
        share = self.step_cost.draft_share(decoding, size)
        rate = (request.draft_kept + 1) / (request.drafted + 2)
        return share is None or sum(rate**i for i in range(1, size + 1)) > share

    def speculates(self, request):
        """A seeded sample must not depend on its neighbours, as drafts (offered only while
        the batch is small) would make it; penalties change with every token; and logprobs
        are the decode step's own numbers (a draft is verified through prefill attention,
        whose rounding differs)."""
        params = request.params
        if not self.verifies_drafts or not params.speculative or params.penalised or params.logprobs:
            return False
        return params.greedy or params.seed is None

    def beam_chunks(self, request):
        """Each live beam's newest token, whose KV this step computes."""
        start = len(request.prompt_ids) + len(request.beam.running[0]) - 1
        for table in request.beam_tables:
            self.kv.grow(request, table, start + 1)
        return [(request, Chunk([tokens[-1]], start, table, request.request_id)) for tokens, table in zip(request.beam.running, request.beam_tables)]
