"""A paged KV cache: a fixed pool of blocks, per-sequence block tables, and a prefix cache.

The pool is allocated once (`k`, `v`: one [(blocks + 1) * block_size, kv_heads, head_dim]
tensor per layer, so that a compiled step reads each layer's cache as an input of its own rather
than as an offset into a shared one); a sequence owns a list of block ids. The last block is
never handed out: a step padded to a fixed size writes its padding rows there. Admission reserves a request's worst case, so a running
sequence never runs out of blocks and a request that cannot fit waits. Full blocks of finished
sequences stay cached, keyed by a hash of every token up to their end, until the space is
needed (least recently used first).
"""

import hashlib
import heapq
from collections import OrderedDict

import torch

from inference.model_files import head_dim_of

BLOCK_SIZE = 16


def block_hashes(token_ids, block_size):
    """One hash per full block, each covering every token up to that block's end."""
    hashes, digest = [], hashlib.sha256()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest.update(repr(token_ids[start : start + block_size]).encode())
        hashes.append(digest.copy().hexdigest())
    return hashes


class BlockPool:
    @classmethod
    def for_model(cls, config, tokens, block_size, dtype, device):
        """A pool holding `tokens` cached tokens of every layer of this model."""
        blocks = max(1, tokens // block_size)
        return cls(config.num_hidden_layers, blocks, block_size, config.num_key_value_heads, head_dim_of(config), dtype, device)

    def __init__(self, num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.scratch_block = num_blocks
        shape = ((num_blocks + 1) * block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]  # each [slots, H_kv, D]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.free = list(range(num_blocks))  # a heap: the lowest block first, so a sequence's
        # blocks tend to be neighbours and reading them is close to one sequential copy
        self.refs = [0] * num_blocks
        self.cached = OrderedDict()  # hash -> block, least recently used first
        self.hash_of = {}  # block -> hash, for cached blocks
        self.idle_cached = 0  # cached blocks nobody uses: evictable
        self.reserved = 0

    def available(self):
        """Blocks that can be handed out: free ones and cached ones nobody uses."""
        return len(self.free) + self.idle_cached - self.reserved

    def reserve(self, count):
        if count > self.available():
            return False
        self.reserved += count
        return True

    def unreserve(self, count):
        self.reserved -= count

    def allocate(self):
        """One block from the caller's reservation."""
        self.reserved -= 1
        block = heapq.heappop(self.free) if self.free else self._evict()
        self.refs[block] = 1
        return block

    def _evict(self):
        for digest, block in self.cached.items():
            if self.refs[block] == 0:
                del self.cached[digest], self.hash_of[block]
                self.idle_cached -= 1
                return block
        raise RuntimeError("no block to evict: a reservation was not honoured")

    def lookup(self, hashes):
        """The longest run of cached blocks for these hashes, now referenced by the caller."""
        blocks, matched = [], []
        for digest in hashes:
            block = self.cached.get(digest)
            # An idle cached block may be counted in someone's reservation: take it only if
            # that leaves the reservations whole.
            if block is None or (self.refs[block] == 0 and self.available() < 1):
                break
            if self.refs[block] == 0:
                self.idle_cached -= 1
            self.refs[block] += 1
            blocks.append(block)
            matched.append(digest)
        for digest in reversed(matched):  # most recent last, the chain's head newest of all:
            self.cached.move_to_end(digest)  # eviction then takes a chain from its tail
        return blocks

    def register(self, block, digest):
        """Keep a full, computed block for later prompts with the same beginning."""
        if digest not in self.cached and block not in self.hash_of:
            self.cached[digest] = block
            self.hash_of[block] = digest
            self.idle_cached += self.refs[block] == 0

    def share(self, blocks):
        """Another holder of blocks already held: a beam forked from its parent."""
        for block in blocks:
            self.refs[block] += 1

    def copy(self, source, target):
        """Copy one block's keys and values, every layer (copy on write for a forked beam)."""
        size = self.block_size
        for cache in (*self.k, *self.v):
            cache[target * size : (target + 1) * size] = cache[source * size : (source + 1) * size]

    def nbytes(self):
        return sum(cache.numel() * cache.element_size() for cache in (*self.k, *self.v))

    def release(self, blocks):
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0 and block in self.hash_of:
                self.idle_cached += 1
            elif self.refs[block] == 0:
                heapq.heappush(self.free, block)
