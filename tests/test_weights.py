"""The weight formats the engine may compute with, and what each costs in agreement."""

import pytest
import torch

from inference.worker.engine import Request, SamplingParams
from inference.worker.engine.llama import Int4, Int8, LlamaWeights, formats_for, score
from inference.worker.engine.runner import Chunk
from tests.test_engine import QUESTIONS, chat, real_engine, run

# README: what a user trades for a reduced format, measured by this test's prompt set.
MIN_TOP1_AGREEMENT = 0.93


def greedy_replies(engine, prompts, tokens=40):
    requests = [Request(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0, speculative=False)) for i, prompt in enumerate(prompts)]
    engine.add(*requests)
    run(engine)
    return [r.output_ids for r in requests]


def top1(engine, prompt, reply):
    """The format's own pick after every token of float32's reply (teacher forcing)."""
    ids = prompt + reply
    blocks = list(range(-(-len(ids) // 16)))
    logits = engine.runner.forward([Chunk(ids, 0, blocks, "probe", all_logits=True)])
    return logits[len(prompt) - 1 : -1].argmax(-1)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_a_reduced_format_agrees_with_float32_on_the_next_token_almost_everywhere(model, fmt):
    prompts = [chat(model, q) for q in QUESTIONS]
    replies = greedy_replies(real_engine(model), prompts)
    engine = real_engine(model, weights=fmt)
    agree = total = 0
    for prompt, reply in zip(prompts, replies):
        agree += int((top1(engine, prompt, reply) == torch.tensor(reply)).sum())
        total += len(reply)
    assert agree / total >= MIN_TOP1_AGREEMENT, f"{fmt}: {agree} of {total}"


def test_int4_keeps_the_4_bit_matrices_of_the_gguf_and_gives_the_embedding_int8(model):
    weights = LlamaWeights(model.model, "int4")
    assert all(isinstance(layer.gate_up, Int4) and layer.gate_up.error < 0.01 for layer in weights.layers)
    assert isinstance(weights.lm_head, Int8)  # 6-bit in the GGUF: 4 bits would lose too much


def test_auto_decodes_and_prefills_in_the_formats_that_measured_fastest_here(model):
    decoding, prefilling = formats_for(model.model, "auto", model.device)
    timings = decoding.timings  # seconds at 1, 32 and PREFILL_TOKENS tokens
    assert set(timings) == {"float32", "bfloat16", "int8", "int4"}
    assert score(timings[decoding.format]) == min(map(score, timings.values()))
    assert timings[prefilling.format][2] == min(times[2] for times in timings.values())
    assert formats_for(model.model, "auto", model.device)[0] is decoding  # measured once per process
