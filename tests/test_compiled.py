"""The compiled step (inference/worker/engine/compiled.py): one program serves every step without
compiling again, gives the tokens the eager step gives, and a compile that fails leaves an
engine that still serves, eagerly. That a row's logits do not depend on what travels with it
is tests/test_invariance.py's, for the compiled step as for the eager one."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from inference.worker import engines
from inference.worker.engine import Request, SamplingParams, compiled, formats
from inference.worker.engine.runner import Chunk
from tests.test_engine import NO_SPECIALS, chat, real_engine, run, text_of

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "Explain what a prime number is, briefly.",
    "Say hello in French, Spanish and German.",
]


def greedy_replies(engine, model, tokens=32):
    for n, text in enumerate(PROMPTS):
        engine.add(Request(f"p{n}", chat(model, text), SamplingParams(max_tokens=tokens, temperature=0, logit_bias=NO_SPECIALS)))
    outputs = run(engine)
    return [text_of(outputs, f"p{n}") for n in range(len(PROMPTS))]


def test_every_shape_of_step_runs_through_one_program_precompiled_or_traced(model, worker_saved):
    """The precompiled program runs without guards, so it must serve every shape a step takes
    with the numbers the guarded, traced one gives; and the traced one (CUDA's) must serve them
    all without compiling again. The precompiled one is the worker's, loaded from its file."""
    engine = worker_engine(model, worker_saved, compile=True)
    assert engine.runner.compiled is not None and engine.runner.compiled.precompiled is not None
    traced = compiled.CompiledStep(engine.runner)  # no warm-up: torch.compile traces at its first step
    blocks = [list(range(k * 40, k * 40 + 40)) for k in range(8)]
    steps = [
        [Chunk([5], 0, blocks[0])],  # a first decode, one block wide
        [Chunk(list(range(100, 150)), 0, blocks[1])],  # a prompt of 50 tokens
        [Chunk(list(range(200, 240)), 0, blocks[2], all_logits=True)],  # every row's logits
        [Chunk([7], 49, blocks[1]), Chunk([8, 9, 10, 11, 12], 50, blocks[1], drafted=4)],  # drafts to verify
        [Chunk([9], 300 + k, blocks[k]) for k in range(1, 8)],  # seven decodes, twenty blocks wide
        [Chunk([3], 600, blocks[3]), Chunk(list(range(24)), 10, blocks[4])],  # a decode beside a prompt piece
    ]
    with torch.inference_mode():
        traced(steps[0])
        with torch.compiler.set_stance("fail_on_recompile"):
            for chunks in steps:
                logits = engine.runner.forward(chunks)
                assert logits.shape == (sum(c.logit_rows() for c in chunks), model.model.config.vocab_size)
                assert torch.isfinite(logits).all() and torch.equal(traced(chunks), logits)


def test_compiled_and_eager_give_the_same_greedy_replies(model):
    """In float32 the two differ by rounding alone (about 1e-6 of a logit), so every greedy
    token agrees. (In int8 and int4, activations are rounded to int8, where a last-bit
    difference can move a rounding and, some tokens later, a near tie: there the reduced
    formats are held to the same quality instead, below.)"""
    eager = greedy_replies(real_engine(model, weights="float32"), model)
    assert greedy_replies(real_engine(model, weights="float32", compile=True), model) == eager
    assert all(len(reply) > 40 for reply in eager)


def test_compiled_reads_the_evaluation_text_as_well_as_eager_in_the_workers_format(model, worker_saved):
    """The same quality, not the same logits: in the reduced formats the activations are rounded
    to int8, and a difference of 1e-6 between the two paths moves some of those roundings, which
    moves the logits about as far as int4 itself does (a 1e-6 perturbation of eager's own
    activations did the same here: top-1 agreement 96.7%, perplexity within 0.1%)."""
    figures = {}
    for mode in ("eager", "compiled"):
        engine = worker_engine(model, worker_saved, cache_tokens=4096, compile=mode == "compiled")
        logits, targets = teacher_forced(engine.runner, model.tokenizer)
        figures[mode] = (float(torch.nn.functional.cross_entropy(logits, targets).exp()), logits.argmax(-1))
    (eager, eager_picks), (compiled_, compiled_picks) = figures["eager"], figures["compiled"]
    assert abs(compiled_ / eager - 1) < 0.005, (eager, compiled_)
    assert (compiled_picks == eager_picks).float().mean() > 0.95


def teacher_forced(runner, tokenizer, window=256, windows=8):
    """Logits along the first 2,048 tokens of the evaluation text, in windows each read from an
    empty context (as formats.py reads the whole text): over 512 the two parted by 0.5% in
    perplexity, over 2,048 by 0.1%."""
    ids = tokenizer.encode(formats.EVAL_TEXT.read_text(), add_special_tokens=False)[: window * windows]
    blocks = list(range(-(-window // 16)))
    with torch.inference_mode():
        pieces = [runner.forward([Chunk(ids[s : s + window], 0, blocks, all_logits=True)]) for s in range(0, len(ids), window)]
    return torch.cat(pieces)[:-1].float(), torch.tensor(ids[1:])


WORKER_START = """
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sys.path.insert(0, ".")
    import django
    django.setup()
    from inference.worker import engines
    from inference.worker.engine import Request, SamplingParams

    engine = engines.build_engine(engines.load("smollm2-135m-instruct"))
    engine.add(Request("r", [1, 9690, 198], SamplingParams(max_tokens=8, temperature=0)))
    produced = 0
    while engine.has_work():
        produced += sum(len(o.text) for o in engine.step())
    print("compiled:", engine.runner.compiled is not None, "produced:", produced)
"""


def worker_start(data_dir, settings, **env):
    """A worker's engine built as a worker builds it, in a process of its own (Django and
    Daphne's Twisted loaded), over an empty data directory but for the checkout's model and its
    measured weight format; -> (stdout, log lines)."""
    if not (data_dir / "weights").exists():
        shutil.copytree(settings.CACHE_DIR / "weights", data_dir / "weights")
    env = {
        **os.environ,
        "TOKSTREAM_CACHE_DIR": str(data_dir),
        "TOKSTREAM_MODEL_CACHE": str(settings.TOKSTREAM_MODEL_CACHE),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "TOKSTREAM_COMPILE": "true",  # as shipped, and whatever the environment says: these tests are of it
        **env,
    }
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(WORKER_START)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "produced: 0" not in done.stdout, done.stdout
    return done.stdout, done.stderr.splitlines()


@pytest.fixture(scope="module")
def worker_saved(tmp_path_factory):
    """The data directory of a worker's first start, which compiled its step and saved it (the
    module's other compiled engines load that program rather than compile it again)."""
    from django.conf import settings

    data_dir = tmp_path_factory.mktemp("data")
    out, first = worker_start(data_dir, settings)
    assert "compiled: True" in out and any("compiled step: compiled in" in line and "saved as" in line for line in first), first[-20:]
    return data_dir


def worker_engine(model, data_dir, **options):
    """An engine in the weight format the worker runs (`auto`'s choice here), its compiled step
    the one that worker saved in `data_dir`."""
    fmt = formats.chosen(model.model, model.tokenizer, model.device, engines.formats_file(model))
    return real_engine(model, weights=fmt, compile_cache=data_dir / "compiled", **options)


def test_a_restart_loads_the_step_the_first_start_compiled_and_saved(worker_saved, settings):
    out, again = worker_start(worker_saved, settings)
    assert "compiled: True" in out and any("compiled step: loaded" in line for line in again), again[-20:]
    assert not any("did not load" in line or "compiled in" in line for line in again), again[-20:]


def test_a_compile_that_fails_leaves_a_worker_engine_that_serves_eagerly_and_says_why_once(tmp_path, settings):
    # A machine without a working C++ compiler (CXX names one that fails), with nothing
    # compiled before: the start must still give an engine, on the eager step.
    out, lines = worker_start(tmp_path, settings, CXX="/bin/false")
    assert "compiled: False" in out, out
    said = [line for line in lines if "compiled step failed" in line]
    assert len(said) == 1, lines[-20:]


@pytest.mark.parametrize("rows, width", [(3, 2), (17, 5), (40, 9)])
def test_bucketed_inputs_pad_rows_into_the_scratch_block_and_tables_with_block_zero(rows, width):
    """How a CUDA step is padded to its graph's sizes, checked where it is built (on the CPU)."""
    block = 16
    chunks = [Chunk([1] * rows, width * block - rows, list(range(10, 10 + width)))]
    inputs = compiled.StepInputs.of(chunks, block, "cpu", scratch_block=99, bucketed=True)
    size = compiled.bucket(rows, compiled.MIN_BUCKET)
    assert inputs.ids.shape == (size,) and inputs.tables.shape == (size, compiled.bucket(width, 1))
    assert (inputs.slots[rows:] == 99 * block).all() and (inputs.tables[rows:] == 0).all()
    assert inputs.logit_rows.tolist()[0] == rows - 1 and len(inputs.logit_rows) == compiled.MIN_BUCKET
