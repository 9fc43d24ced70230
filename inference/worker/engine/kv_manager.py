"""Every KV-cache reservation the engine makes, in one place.

A request takes blocks as it grows: its prompt's when it is admitted, then a block at a time
as it decodes (`top_up` before each step, with room for drafts). When the cache has none left,
the engine preempts the request that started last: it gives its blocks back and waits to be
computed again (scheduler.py). A beam search still reserves its worst case when admitted (the
prompt's full blocks once and the rest per beam), since its beams fork and share blocks as
they go; steering reserves its own (`reserve_steering`), beams fork by sharing blocks and
copying the last partial one (`fork`), and `free` gives everything back, keeping the full
computed blocks in the prefix cache.
"""

import math

from .kv_cache import block_hashes


class KVCacheManager:
    def __init__(self, pool):
        self.pool = pool
        self.block_size = pool.block_size

    def worst_case(self, request):
        """Blocks for the prompt and every token it may produce. Beams share the prompt's
        full blocks and hold the rest each."""
        prompt, width = len(request.prompt_ids), request.params.beam_width
        blocks = math.ceil((prompt + request.params.max_tokens) / self.block_size)
        shared = prompt // self.block_size if width > 1 else 0
        return shared + max(width, 1) * (blocks - shared)

    def never_fits(self, request):
        return self.worst_case(request) > self.pool.num_blocks

    def reserve(self, request, headroom=0):
        """Reuse cached prefix blocks, then take the blocks the sequence needs now, leaving
        `headroom` blocks for the running sequences to grow into; -> whether it fits. A
        preempted request comes back with its whole sequence to compute again."""
        sequence = request.all_ids or request.prompt_ids
        # The last token is always computed: its logits give the next output token.
        hashes = block_hashes(sequence[:-1], self.block_size) if request.all_ids else self.prompt_hashes(request)
        cached = self.pool.lookup(hashes)
        beams = request.params.beam_width > 1
        need = self.worst_case(request) if beams else math.ceil((len(sequence) + 1) / self.block_size)
        if need - len(cached) > self.pool.available() - headroom:
            self.pool.release(cached)
            return False
        self.pool.reserve(need - len(cached))
        # Beams fork as they go: they take the prompt's blocks and keep the rest reserved.
        now = math.ceil(len(sequence) / self.block_size) if beams else need
        request.blocks = cached + [self.pool.allocate() for _ in range(now - len(cached))]
        request.reserved = need - now
        request.computed = len(cached) * self.block_size
        return True

    def top_up(self, request, tokens):
        """Blocks reserved for `tokens` tokens of the sequence (taken as it grows into them);
        -> whether the cache had them."""
        missing = math.ceil(tokens / self.block_size) - len(request.blocks) - request.reserved
        if missing > 0 and not self.pool.reserve(missing):
            return False
        request.reserved += max(missing, 0)
        return True

    def room(self, request):
        """Tokens the request's blocks and reservation hold beyond its sequence so far."""
        return (len(request.blocks) + request.reserved) * self.block_size - len(request.all_ids)

    def grow(self, request, table, end):
        """Blocks from the request's reservation (admission and top_up made it) until the
        table covers `end` tokens."""
        while len(table) * self.block_size < end:
            table.append(self.pool.allocate())
            request.reserved -= 1

    def reserve_steering(self, request, tokens):
        blocks = math.ceil(tokens / self.block_size) + 1  # +1: they may straddle a block
        if not self.pool.reserve(blocks):
            return False
        request.reserved += blocks
        return True

    def fork(self, request, parents, computed):
        """Each new beam takes its parent's block table: full blocks shared, and the last,
        partial one copied for every child of a parent but the first (copy on write)."""
        old, tables = request.beam_tables, [list(request.beam_tables[p]) for p in parents]
        for table in tables:
            self.pool.share(table)
        for table in old:
            self.pool.release(table)
        request.beam_tables = tables
        if tables:  # none left: the search is over, and free() gives the reservation back
            self._cover_worst_case(request)
        if computed % self.block_size:
            last, taken = computed // self.block_size, set()
            for table in tables:
                if table[last] in taken:
                    table[last] = self._copy_block(request, table[last])
                taken.add(table[last])

    def _cover_worst_case(self, request):
        """Reserve again what the beams just gave back, so the worst case stays covered."""
        held = len({block for table in request.beam_tables for block in table})
        missing = self.worst_case(request) - held - request.reserved
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

    def prompt_hashes(self, request):
        """Of the prompt's full blocks, but the last token's; made once (a head that waits asks
        every step)."""
        if request.prompt_hashes is None:
            request.prompt_hashes = block_hashes(request.prompt_ids[:-1], self.block_size)
        return request.prompt_hashes

    def first_uncached(self, request):
        """The hash of the first block of the prompt that the prefix cache does not hold."""
        return next((digest for digest in self.prompt_hashes(request) if digest not in self.pool.cached), None)

    def computing(self, request):
        """Hashes of the prompt blocks the request is still computing."""
        if request.output_ids or request.prompt_hashes is None:
            return []
        return request.prompt_hashes[request.computed // self.block_size :]

    def register_prompt(self, request):
        """Share the prompt's full blocks as soon as they are computed, not only once the whole
        prompt is: requests that arrived together with the same beginning (a chat's system
        turn) then read them instead of computing them each."""
        hashes = request.prompt_hashes or []
        full = min(request.computed // self.block_size, len(hashes))
        for block, digest in reversed(list(zip(request.blocks[:full], hashes[:full]))):
            self.pool.register(block, digest)

    def register_computed(self, request):
        """Keep the request's full computed blocks for later prompts with the same beginning."""
        computed = request.all_ids[: request.computed]
        pairs = list(zip(request.blocks, block_hashes(computed, self.block_size)))
        for block, digest in reversed(pairs):  # a chain's head is the last to be evicted
            self.pool.register(block, digest)

    def free(self, request):
        """Give the blocks back, keeping the full computed ones for later prompts."""
        self.register_computed(request)
        for table in (request.blocks, *request.beam_tables):
            self.pool.release(table)
        self.pool.unreserve(request.reserved)
        request.blocks, request.beam_tables, request.reserved = [], [], 0
