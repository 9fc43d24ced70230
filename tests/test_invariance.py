"""A position's logits are a function of its sequence alone: the same whatever it travels in,
through the eager step and through the compiled one (compiled.py) alike."""

import pytest
import torch

from inference import model_files
from inference.worker.engine import compiled, formats
from inference.worker.engine.kv_cache import BlockPool
from inference.worker.engine.llama import LlamaRunner, LlamaWeights
from inference.worker.engine.runner import Chunk
from tests.test_engine import chat

BLOCK = 16


class Sequences:
    """Sequences on one runner, each with its own blocks, fed by hand-made chunks."""

    def __init__(self, model, fmt, compile=False):
        kv_dtype = getattr(torch, model_files.kv_dtype("auto", fmt, "float32"))  # as the engine keeps it
        self.pool = BlockPool.for_model(model.model.config, 8192, BLOCK, kv_dtype, model.device)
        self.runner = LlamaRunner(model.model, self.pool, model.device, model.context_length, fmt)
        if compile:
            self.runner.compiled = compiled.start(self.runner)
            assert self.runner.compiled is not None
        self.next_block = 0

    def blocks(self, tokens):
        count = -(-tokens // BLOCK)
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def forward(self, *chunks):
        return self.runner.forward(list(chunks))


def prompt_and_reply(model):
    prompt = chat(model, "Write a short poem about the sea, then translate it into French.")
    reply = model.tokenizer.encode(" The sea is wide and grey, la mer est grande et grise, it sings at night.", add_special_tokens=False)
    return prompt, reply


def dense_format(model):
    """float32 where its rows are invariant on this CPU, else bfloat16: on some CPUs (MKL with
    AVX-512 here) float32 rounds a row by the step's size at many sizes, and `auto` never takes
    a format whose rows vary (test_weights)."""
    return "float32" if formats.rows_invariant(LlamaWeights.of(model.model, "float32"), model.model, model.device) else "bfloat16"


@pytest.fixture(scope="module", params=["dense", "int4", "int4 compiled"])
def sequences(model, request):
    fmt = dense_format(model) if request.param == "dense" else "int4"
    return lambda: Sequences(model, fmt, compile=request.param.endswith("compiled"))


def test_a_prompt_gives_the_same_logits_in_one_chunk_in_pieces_and_token_by_token(model, sequences):
    prompt, _ = prompt_and_reply(model)
    whole = sequences()
    blocks = whole.blocks(len(prompt))
    expected = whole.forward(Chunk(prompt, 0, blocks, all_logits=True))  # [P, V]
    for piece in (7, 24, 1):
        pieces = sequences()
        blocks = pieces.blocks(len(prompt))
        got = torch.cat([pieces.forward(Chunk(prompt[s : s + piece], s, blocks, all_logits=True)) for s in range(0, len(prompt), piece)])
        assert torch.equal(got, expected), f"pieces of {piece} differ"


def test_a_decode_gives_the_same_logits_alone_beside_others_and_as_a_verified_draft(model, sequences):
    prompt, reply = prompt_and_reply(model)
    ids = prompt + reply
    alone = sequences()
    blocks = alone.blocks(len(ids))
    alone.forward(Chunk(prompt, 0, blocks))
    expected = torch.cat([alone.forward(Chunk([t], len(prompt) + i, blocks)) for i, t in enumerate(reply)])

    crowd = sequences()
    mine = crowd.blocks(len(ids))
    others = [(crowd.blocks(len(prompt) + 40 * k + len(reply)), list(range(100, 100 + 40 * k + 3))) for k in range(1, 6)]
    for table, other in others:
        crowd.forward(Chunk(other, 0, table))
    crowd.forward(Chunk(prompt, 0, mine))
    rows = []
    for i, token in enumerate(reply):  # beside five decodes of other lengths and a prompt piece
        step = [Chunk([7 + i], len(other) + i, table) for table, other in others]
        step.insert(i % 5, Chunk([token], len(prompt) + i, mine))
        step.append(Chunk(list(range(500, 520)), 0, crowd.blocks(20)))
        rows.append(crowd.forward(*step)[i % 5])
    assert torch.equal(torch.stack(rows), expected)

    drafts = sequences()
    blocks = drafts.blocks(len(ids))
    drafts.forward(Chunk(prompt, 0, blocks))
    verified = [drafts.forward(Chunk(reply[s : s + 5], len(prompt) + s, blocks, all_logits=True)) for s in range(0, len(reply), 5)]
    assert torch.equal(torch.cat(verified), expected)


def test_a_prefix_computed_by_another_request_gives_the_same_logits(model, sequences):
    prompt, reply = prompt_and_reply(model)
    cold = sequences()
    blocks = cold.blocks(len(prompt))
    expected = cold.forward(Chunk(prompt, 0, blocks))
    warm = sequences()
    blocks = warm.blocks(len(prompt))
    cut = len(prompt) // BLOCK * BLOCK
    warm.forward(Chunk(prompt[:cut] + reply, 0, blocks + warm.blocks(len(reply))))  # another request's prompt
    assert torch.equal(warm.forward(Chunk(prompt[cut:], cut, blocks)), expected)
