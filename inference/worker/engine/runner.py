"""What a batched forward pass over the paged KV cache is given, and its attention.

One call computes every scheduled chunk of the step: the linear layers see all tokens at once
(that is where batching pays). Attention treats every token the same way, whatever chunk it
travels in: a one-token decode, a piece of a prompt, a draft to verify. Each token is a row of
its own (one query against its sequence's cached keys up to its position), so its result does
not depend on how many tokens it travels with or how long its neighbours are; a fused kernel
that tiles a chunk's queries together would round each of them by the chunk's shape. The
model's own math is in llama.py.
"""

import itertools
from dataclasses import dataclass

import torch

ROWS_PER_GROUP = 128  # prompt tokens that share one gather of their chunk's keys


@dataclass
class Chunk:
    token_ids: list[int]  # tokens whose KV this step computes
    start: int  # position of the first of them in the sequence
    blocks: list[int]  # the sequence's block table, long enough for start + len(token_ids)
    request_id: str = ""
    all_logits: bool = False  # logits after every token, not only the last (a teacher-forced pass)
    drafted: int = 0  # the last `drafted` of token_ids are draft tokens to verify: their logits come too

    def draft(self):
        return self.token_ids[len(self.token_ids) - self.drafted :] if self.drafted else []

    def logit_rows(self):
        """How many logit rows the pass returns for this chunk: one per token, or the last's."""
        return len(self.token_ids) if self.all_logits or self.drafted else 1


@dataclass
class Group:
    """Tokens that attend in one kernel call, one query each."""

    rows: torch.Tensor  # [B]: where they sit in the flattened batch
    blocks: torch.Tensor  # [B, W] each row's block table, or [1, W] shared by all the rows
    hidden: torch.Tensor  # [B, 1, W * block_size]: -inf at the positions a row does not see, else 0


class AttentionPlan:
    """Where each chunk's tokens sit in the flattened batch, which cache slots they fill, and
    which blocks they read. Reads go by whole blocks: gathering 16-token blocks is several
    times faster on the CPU than gathering token rows."""

    def __init__(self, chunks, block_size, device):
        self.device = device
        self.block_size = block_size
        # Plain lists until each tensor is built: reading a number back from a GPU waits for it.
        lengths = [len(c.token_ids) for c in chunks]
        starts = [0, *itertools.accumulate(lengths)]
        rows = [row for c, start in zip(chunks, starts) for row in range(start + len(c.token_ids) - c.logit_rows(), start + len(c.token_ids))]
        self.logit_rows = torch.tensor(rows, device=device)
        self.slots = torch.tensor([slot for c in chunks for slot in self.new_slots(c)], device=device)  # [N]
        one = [i for i, n in enumerate(lengths) if n == 1]
        self.groups = [self.decode_group([chunks[i] for i in one], [starts[i] for i in one])] if one else []
        for i, chunk in enumerate(chunks):
            if lengths[i] > 1:
                self.groups += self.chunk_groups(chunk, starts[i])

    def new_slots(self, chunk):
        """Cache slots of the chunk's own tokens."""
        size = self.block_size
        return [chunk.blocks[p // size] * size + p % size for p in range(chunk.start, chunk.start + len(chunk.token_ids))]

    def decode_group(self, chunks, rows):
        """One-token chunks, each reading its own blocks (padded to the longest)."""
        tables = [c.blocks[: -(-(c.start + 1) // self.block_size)] for c in chunks]
        width = max(map(len, tables))
        blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)  # [B, W]
        return self.group(rows, blocks, [c.start for c in chunks], width)

    def chunk_groups(self, chunk, first_row):
        """A longer chunk's tokens in groups that share their keys, each group reading the
        blocks up to its last token (causal: a group of early tokens gathers less)."""
        groups = []
        for offset in range(0, len(chunk.token_ids), ROWS_PER_GROUP):
            count = min(ROWS_PER_GROUP, len(chunk.token_ids) - offset)
            positions = [chunk.start + offset + i for i in range(count)]
            width = -(-(positions[-1] + 1) // self.block_size)
            table = torch.tensor([chunk.blocks[:width]], device=self.device)  # [1, W]
            groups.append(self.group(list(range(first_row + offset, first_row + offset + count)), table, positions, width))
        return groups

    def group(self, rows, blocks, positions, width):
        later = torch.arange(width * self.block_size, device=self.device)[None, :] > torch.tensor(positions, device=self.device)[:, None]
        hidden = torch.zeros(later.shape, device=self.device).masked_fill(later, float("-inf"))
        return Group(torch.tensor(rows, device=self.device), blocks, hidden[:, None, :])


class PagedAttention:
    """Each token attends to its own sequence's cached keys and values."""

    def __init__(self, pool, kv_heads, head_dim, device):
        self.pool = pool
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.device = device
        self.workspace = {}

    def buffer(self, name, like, count, dtype):
        """A reused buffer of `count` blocks: a fresh multi-megabyte tensor per layer costs more
        in page faults than the copy into it."""
        buffer = self.workspace.get(name)
        if buffer is None or buffer.shape[0] < count:
            buffer = self.workspace[name] = like.new_empty((max(count, 64), *like.shape[1:]), dtype=dtype)
        return buffer[:count]

    def gather(self, cache, blocks, name, dtype):
        """cache[blocks] in `dtype`: a 16-bit cache is read in the queries' dtype, so the
        products are the same whichever dtype the cache keeps."""
        stored = torch.index_select(cache, 0, blocks, out=self.buffer(name, cache, len(blocks), cache.dtype))
        return stored if cache.dtype == dtype else self.buffer(f"{name}-wide", cache, len(blocks), dtype).copy_(stored)

    def __call__(self, layer, q, plan):
        """q: [N, Hq, D] -> [N, Hq * D]."""
        by_block = (-1, self.pool.block_size, self.kv_heads, self.head_dim)
        k_cache, v_cache = self.pool.k[layer].view(by_block), self.pool.v[layer].view(by_block)  # [blocks, BS, Hkv, D]
        out = torch.empty_like(q)
        for group in plan.groups:
            out[group.rows] = self.attend(q[group.rows], k_cache, v_cache, group)
        return out.flatten(1)

    def attend(self, q, k_cache, v_cache, group):
        """q: [B, Hq, D] -> [B, Hq, D], one query per row.

        Written out rather than through scaled_dot_product_attention: its fused CPU kernel
        rounds a row by which thread computes it (the row's place in the batch). Each row and
        key-value head is one small matrix product of the same shape whatever the step holds
        ([queries of the head group, D] @ [D, C]); the positions a row does not see weigh
        exactly zero, so padding to a longer neighbour changes nothing."""
        rows, kv_heads = len(q), self.kv_heads
        shape = (group.blocks.shape[0], -1, kv_heads, self.head_dim)
        keys = self.gather(k_cache, group.blocks.flatten(), "k", q.dtype).view(shape)  # [B or 1, C, Hkv, D]
        values = self.gather(v_cache, group.blocks.flatten(), "v", q.dtype).view(shape)
        q = q.view(rows, kv_heads, -1, self.head_dim)  # [B, Hkv, G, D]
        out = torch.empty_like(q)
        for head in range(kv_heads):  # a head's keys are a strided view: no copies
            k, v = keys[:, :, head].expand(rows, -1, -1), values[:, :, head].expand(rows, -1, -1)  # [B, C, D]
            out[:, head] = attention(q[:, head], k, v, group.hidden, self.head_dim**-0.5)
        return out.flatten(1, 2)


def attention(q, k, v, hidden, scale):
    """q: [N, G, D], k and v: [N, C, D], hidden: [N, 1, C] -> [N, G, D]."""
    scores = torch.baddbmm(hidden, q, k.transpose(1, 2), alpha=scale)  # hidden: 0 where seen, -inf where not
    return torch.bmm(torch.softmax(scores, dim=-1), v)
