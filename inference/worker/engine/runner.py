"""What a batched forward pass over the paged KV cache is given, and its attention.

One call computes every scheduled chunk of the step: the linear layers see all tokens at once
(that is where batching pays), attention runs once for all one-token chunks (decodes, padded
to the longest context) and once per longer chunk (prefill pieces and drafts, causal over
their prefix). The model's own math is in llama.py.
"""

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Chunk:
    token_ids: list[int]  # tokens whose KV this step computes
    start: int  # position of the first of them in the sequence
    blocks: list[int]  # the sequence's block table, long enough for start + len(token_ids)
    request_id: str = ""
    all_logits: bool = False  # logits after every token, not only the last: a draft to verify
    wide: bool = False  # prompt (or steering) tokens: for the prefill weights; such chunks come last


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
        rows = [row for c, start in zip(chunks, starts) for row in (range(start, start + len(c.token_ids)) if c.all_logits else [start + len(c.token_ids) - 1])]
        self.logit_rows = torch.tensor(rows, device=device)
        # Rows before the first wide chunk go through the decoding weights, the rest through
        # the prefill weights (the runner's two formats, when they differ).
        first_wide = next((i for i, c in enumerate(chunks) if c.wide), len(chunks))
        self.decode_rows = starts[first_wide]
        self.decode_logits = sum(row < self.decode_rows for row in rows)
        self.slots = torch.tensor([slot for c in chunks for slot in self.new_slots(c)], device=device)  # [N]
        one = [i for i, n in enumerate(lengths) if n == 1]
        self.decode = self.decode_group([chunks[i] for i in one], torch.tensor([starts[i] for i in one], device=device)) if one else None
        self.prefills = [self.prefill_group(c, starts[i]) for i, c in enumerate(chunks) if lengths[i] > 1]

    def new_slots(self, chunk):
        """Cache slots of the chunk's own tokens."""
        size = self.block_size
        return [chunk.blocks[p // size] * size + p % size for p in range(chunk.start, chunk.start + len(chunk.token_ids))]

    def used_blocks(self, chunk):
        end = chunk.start + len(chunk.token_ids)
        return chunk.blocks[: -(-end // self.block_size)], end

    def decode_group(self, chunks, rows):
        tables, lengths = zip(*(self.used_blocks(c) for c in chunks))
        width = max(map(len, tables))
        blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)  # [B, W]
        visible = torch.arange(width * self.block_size, device=self.device)[None, :] < torch.tensor(lengths, device=self.device)[:, None]
        return rows, blocks, visible[:, None, None, :]  # mask: [B, 1, 1, W * block_size]

    def prefill_group(self, chunk, first_row):
        table, _ = self.used_blocks(chunk)
        query_pos = chunk.start + torch.arange(len(chunk.token_ids), device=self.device)
        causal = torch.arange(len(table) * self.block_size, device=self.device)[None, :] <= query_pos[:, None]  # [L, C]
        return slice(first_row, first_row + len(chunk.token_ids)), torch.tensor(table, device=self.device), causal


class PagedAttention:
    """Each token attends to its own sequence's cached keys and values."""

    def __init__(self, pool, kv_heads, head_dim, device):
        self.pool = pool
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.device = device
        self.workspace = {}

    def gather(self, cache, blocks, name):
        """cache[blocks] into a reused buffer: a fresh multi-megabyte tensor per layer costs
        more in page faults than the copy itself."""
        buffer = self.workspace.get(name)
        if buffer is None or buffer.shape[0] < len(blocks):
            buffer = self.workspace[name] = cache.new_empty((max(len(blocks), 64), *cache.shape[1:]))
        return torch.index_select(cache, 0, blocks, out=buffer[: len(blocks)])

    def __call__(self, layer, q, plan):
        """q: [N, Hq, D] -> [N, Hq * D]."""
        by_block = (-1, self.pool.block_size, self.kv_heads, self.head_dim)
        k_cache, v_cache = self.pool.k[layer].view(by_block), self.pool.v[layer].view(by_block)  # [blocks, BS, Hkv, D]
        out = torch.empty_like(q)
        if plan.decode is not None:
            rows, blocks, mask = plan.decode
            shape = (blocks.shape[0], -1, self.kv_heads, self.head_dim)
            keys = self.gather(k_cache, blocks.flatten(), "k").view(shape).transpose(1, 2)  # [B, Hkv, C, D]
            values = self.gather(v_cache, blocks.flatten(), "v").view(shape).transpose(1, 2)
            out[rows] = F.scaled_dot_product_attention(q[rows][:, :, None], keys, values, attn_mask=mask, enable_gqa=True)[:, :, 0]
        for rows, blocks, mask in plan.prefills:
            keys = self.gather(k_cache, blocks, "k").flatten(0, 1).transpose(0, 1)[None]  # [1, Hkv, C, D]
            values = self.gather(v_cache, blocks, "v").flatten(0, 1).transpose(0, 1)[None]
            attended = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True)
            out[rows] = attended[0].transpose(0, 1)
        return out.flatten(1)
