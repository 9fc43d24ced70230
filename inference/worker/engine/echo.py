"""A model with no weights that replies with the conversation's last user message, one token
per step, through the real engine, tokenizer and detokenizer.

It makes every path around the model deterministic and cheap (the chat page's rendering
tests, its benchmark, tool-call streams): what the user sends is exactly what streams back.
It works with ChatML chat templates (`<|im_start|>role ... <|im_end|>`), as SmolLM2's.
"""

import time
from dataclasses import dataclass

import torch

from .kv_cache import BlockPool

CERTAIN = 1e4  # far enough apart that no temperature makes another token likely


@dataclass
class EchoModel:
    """What LoadedModel.model holds for an echo model: the markers it reads the prompt by."""

    user_start: list[int]  # "<|im_start|>user\n"
    reply_start: list[int]  # "<|im_start|>assistant\n"
    end_id: int  # "<|im_end|>"
    vocab_size: int
    step_seconds: float = 0.0  # a real model's pace, so a page sees the reply grow

    @classmethod
    def for_tokenizer(cls, tokenizer, step_seconds=0.0):
        def ids(text):
            return tokenizer.encode(text, add_special_tokens=False)

        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if end is None or end == tokenizer.unk_token_id:
            raise ValueError("the echo model needs a ChatML tokenizer (one with <|im_end|>)")
        return cls(ids("<|im_start|>user\n"), ids("<|im_start|>assistant\n"), end, len(tokenizer), step_seconds)


class EchoRunner:
    """The engine's runner for an EchoModel. Its "KV cache" holds token ids by slot, so a
    chunk whose prompt came partly from the prefix cache still sees the whole sequence."""

    device = torch.device("cpu")

    def __init__(self, model, cache_tokens, block_size):
        self.model = model
        self.pool = BlockPool(1, max(1, cache_tokens // block_size), block_size, 1, 1, torch.float32, "cpu")
        self.slots = [0] * (self.pool.num_blocks * block_size)

    def forward(self, chunks):
        if self.model.step_seconds:
            time.sleep(self.model.step_seconds)
        return torch.stack([self.next_logits(chunk) for chunk in chunks])

    def next_logits(self, chunk):
        sequence = self.write(chunk)
        logits = torch.full((self.model.vocab_size,), -CERTAIN)
        logits[self.next_token(sequence)] = CERTAIN
        return logits

    def write(self, chunk):
        """Store the chunk's ids in its slots and read back the sequence up to its end."""
        size = self.pool.block_size
        slot = lambda position: chunk.blocks[position // size] * size + position % size  # noqa: E731
        for offset, token in enumerate(chunk.token_ids):
            self.slots[slot(chunk.start + offset)] = token
        return [self.slots[slot(p)] for p in range(chunk.start + len(chunk.token_ids))]

    def next_token(self, sequence):
        """The token after `sequence` in an echo of the last user turn before the reply (a
        steering turn counts: the reply then echoes the steering)."""
        reply = last_index(sequence, self.model.reply_start)
        if reply < 0:
            return self.model.end_id
        user = last_index(sequence[:reply], self.model.user_start)
        if user < 0:
            return self.model.end_id
        turn = sequence[user + len(self.model.user_start) : reply]
        said = turn[: turn.index(self.model.end_id)] if self.model.end_id in turn else turn
        written = len(sequence) - reply - len(self.model.reply_start)
        return said[written] if written < len(said) else self.model.end_id


def last_index(sequence, part):
    """Where `part` last starts in `sequence`, or -1."""
    width = len(part)
    for start in range(len(sequence) - width, -1, -1):
        if sequence[start : start + width] == part:
            return start
    return -1
