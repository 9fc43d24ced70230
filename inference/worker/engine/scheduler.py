"""Which piece of which running request a step computes.

A decoding request gets its next token, with prompt-lookup drafts to verify where the tokens
it is likely to keep pay for the longer step; each live beam its newest token; prefilling
requests pieces of their prompts, first come first served, under the budget of budget.py.
"""

from .budget import prefill_budget
from .runner import Chunk
from .speculative import Drafter

DRAFT_LENGTH = 4  # draft tokens per sequence and step
# Draft tokens a step may verify, less one per decoding sequence: while a step's matrix products
# are bound by reading the weights, a few more tokens cost little; in a big batch they would not.
DRAFT_TOKENS = 8


class Scheduler:
    def __init__(self, kv, step_cost, context_length, step_tokens, idle_chunk, clock, verifies_drafts):
        self.kv = kv  # the engine's KV-cache manager: a chunk grows its request's blocks
        self.step_cost = step_cost  # the engine's measured step times
        self.context_length = context_length
        self.step_tokens = step_tokens  # tokens per step while others decode: their gap stays short
        self.idle_chunk = idle_chunk  # prefill chunk when nobody waits on this step
        self.clock = clock
        self.verifies_drafts = verifies_drafts  # the runner can score drafts in one pass

    def schedule(self, running):
        """This step's (request, chunk) pairs."""
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
        oldest = min((r.arrived_at for r in first), default=None)
        waited = self.clock() - oldest if oldest is not None else 0.0
        return prefill_budget(decoding, sum(r.pending() for r in first), waited, self.step_cost, self.step_tokens, self.idle_chunk)

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
