"""Which weight format a model computes in on this machine: measured once, kept in a file.

A format is a candidate only where its kernels give a token's row the same numbers whatever
else travels in the step (checked here, on this CPU), and only within PERPLEXITY_BOUND of the
model's own dtype on a fixed evaluation text (eval_text.txt, teacher-forced). Among those,
`auto` takes the format whose linear layers run fastest for one stream and for 32 at once.
The quality figures are taken through the KV cache's dtype that each format gets.
Timings taken while something else holds the CPUs are not measurements, so the formats are
timed in turns, round after round, until a round leaves the pick from the best times as it
was; the result is written to a file that every later start reads, and only
`manage.py measure_weights` measures again.
"""

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from inference import model_files

from .cpu_ops import cpu_description
from .kv_cache import BlockPool
from .llama import FORMATS, LlamaRunner, LlamaWeights
from .runner import Chunk

log = logging.getLogger(__name__)
EVAL_TEXT = Path(__file__).with_name("eval_text.txt")
PERPLEXITY_BOUND = 1.05  # a reduced format may be at most 5% more perplexed than the model's own
BATCHES = (1, 32)  # one stream is bound by weight bytes, 32 by arithmetic
MAX_ROUNDS = 8
MARGIN = 0.10  # formats this close are a tie that noise could decide either way
OUT_OF_REACH = 2.0  # a first look this many times slower than the fastest: not worth a quality measurement
EVAL_CHUNK = 512
EVAL_WINDOW = 1024  # tokens of context at most: attention over the whole text was half the measurement's time
METHOD = 6  # how the figures are taken; 2: through the KV cache's dtype each format gets; 3: a first look at speed; 4: windows; 5: int8 through the engine's own operator; 6: its integer products


class Unmeasured(Exception):
    """The timings never agreed: the CPUs were busy the whole time."""


def own_format(model):
    return str(model.dtype).removeprefix("torch.")


def candidates(model, device):
    """Formats worth measuring here. The CPU's packed int kernels exist in every torch build, but
    whether they beat float32 depends on the CPU: only a measurement tells."""
    own = own_format(model)
    if device.type != "cpu":
        return [own]
    return list(dict.fromkeys([own, "float32", "bfloat16", "int8", "int4"]))


def machine_key(model, device):
    """What a measurement holds for: the model, the device, the CPU and the torch build."""
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    parts = [config, str(device), torch.__version__, str(torch.get_num_threads()), cpu_description(), f"method {METHOD}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def chosen(model, tokenizer, device, path):
    """The format for `auto`: the one kept in `path` for this model and machine, or measured now
    and kept there (with no `path`, measured and not kept)."""
    key, path = machine_key(model, device), path and Path(path)
    report = path and read(path, key)
    if report is None:
        try:
            report = measure(model, tokenizer, device)
        except Unmeasured as exc:
            own = own_format(model)
            log.warning("weights: %s for this start, nothing kept: %s", own, exc)
            return own
        if path:  # no file: a benchmark's engine, measured for itself
            write(path, {**report, "key": key})
        how = "measured now"
    else:
        how = "measured on " + report["measured_at"]
    log.info("weights: %s (%s, kept in %s); %s", report["format"], how, path, describe(report))
    return report["format"]


def read(path, key):
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and report.get("key") == key and report.get("format") in FORMATS else None


def write(path, report):
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=1, sort_keys=True))
    os.replace(partial, path)  # a start that reads meanwhile sees the old file or the new one


def measure(model, tokenizer, device):
    """-> {"format", "formats": {fmt: figures}, "rounds", "measured_at"}."""
    formats = candidates(model, device)
    own = own_format(model)
    worth, slower = within_reach(one_round(model, formats, device, repeats=1), own)
    figures = {**qualities(model, tokenizer, device, worth), **slower}
    bound = figures[own]["perplexity"] * PERPLEXITY_BOUND
    allowed = [fmt for fmt in worth if figures[fmt]["row_invariant"] and figures[fmt]["perplexity"] <= bound] or [own]
    allowed.sort(key=lambda fmt: figures[fmt]["perplexity"])  # a near tie in speed goes to the less perplexed
    timings, best, rounds = agreed_timings(model, allowed, device)
    for fmt, times in timings.items():
        figures[fmt]["ms_per_step"] = {str(b): round(t * 1e3, 2) for b, t in zip(BATCHES, times)}
    for fmt in set(formats) - {best}:
        model.__dict__.get("_tokstream_weights", {}).pop(fmt, None)  # measured, not kept
    return {"format": best, "formats": {fmt: figures[fmt] for fmt in formats}, "rounds": rounds, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def within_reach(first_look, own):
    """(the formats worth a quality measurement: the model's own, the reference, and those
    within OUT_OF_REACH of the fastest; {fmt: figures} of the rest). Teacher-forcing the
    evaluation text through a format costs 20 to 50 s here: bfloat16 on a CPU without bfloat16
    arithmetic is five times slower and would never be picked."""
    fastest = min(score(times) for times in first_look.values())
    worth = [fmt for fmt, times in first_look.items() if fmt == own or score(times) <= OUT_OF_REACH * fastest]
    slower = {fmt: {"slower": round(score(times) / fastest, 1)} for fmt, times in first_look.items() if fmt not in worth}
    return worth, slower


def score(times):
    return math.sqrt(times[0] * times[1])


def describe(report):
    parts = []
    for fmt, figures in report["formats"].items():
        if "slower" in figures:
            parts.append(f"{fmt}: x{figures['slower']} slower than the fastest at a first look, not measured further")
            continue
        times = figures.get("ms_per_step")
        speed = " / ".join(f"{t} ms" for t in times.values()) if times else "not timed"
        parts.append(
            f"{fmt}: perplexity {figures['perplexity']}, top-1 {figures['top1']}, rows {'invariant' if figures['row_invariant'] else 'VARY'}, linear layers at 1 / 32 tokens {speed}"
        )
    return "; ".join(parts)


# -- quality ------------------------------------------------------------------------------------


@torch.inference_mode()
def teacher_forced(model, tokenizer, device, fmt, kv_dtype="auto"):
    """The evaluation text through the format and a KV cache in `kv_dtype` (`auto`: the one
    that the format gets, model_files.kv_dtype), every position's logits: [tokens - 1, V]."""
    ids = tokenizer.encode(EVAL_TEXT.read_text(), add_special_tokens=False)
    kv_dtype = getattr(torch, model_files.kv_dtype(kv_dtype, fmt, own_format(model)))
    pool = BlockPool.for_model(model.config, EVAL_WINDOW + 16, 16, kv_dtype, device)
    runner = LlamaRunner(model, pool, device, EVAL_WINDOW + 1, fmt)
    blocks = list(range(pool.num_blocks))
    pieces = []
    for window in range(0, len(ids), EVAL_WINDOW):  # each from an empty context, over the same blocks
        text = ids[window : window + EVAL_WINDOW]
        pieces += [runner.forward([Chunk(text[s : s + EVAL_CHUNK], s, blocks, "eval", all_logits=True)]) for s in range(0, len(text), EVAL_CHUNK)]
    return torch.cat(pieces)[:-1].float(), torch.tensor(ids[1:], device=device)


def qualities(model, tokenizer, device, formats):
    """{fmt: perplexity on the evaluation text, top-1 agreement with the model's own dtype,
    and whether its rows are invariant here}."""
    own = own_format(model)
    figures, reference = {}, None
    for fmt in [own, *(f for f in formats if f != own)]:
        logits, targets = teacher_forced(model, tokenizer, device, fmt)
        picks = logits.argmax(-1)
        reference = picks if reference is None else reference
        figures[fmt] = {
            "perplexity": round(float(torch.exp(torch.nn.functional.cross_entropy(logits, targets))), 4),
            "top1": round(float((picks == reference).float().mean()), 4),
            "row_invariant": rows_invariant(LlamaWeights.of(model, fmt), model, device),
        }
    return {fmt: figures[fmt] for fmt in formats}


@torch.inference_mode()
def rows_invariant(weights, model, device, sizes=(1, 2, 3, 5, 8, 17, 40, 300)):
    """Whether each linear layer gives a row the same numbers in a step of any size here."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    layers = (weights.layers[0].qkv, weights.layers[0].down, weights.lm_head)
    for layer in layers:
        x = torch.randn(max(sizes), layer.in_features, generator=generator).to(device=device, dtype=model.dtype)
        whole = layer(x)
        if not all(torch.equal(layer(x[:size]), whole[:size]) for size in sizes):
            return False
    return True


# -- speed --------------------------------------------------------------------------------------


def agreed_timings(model, formats, device):
    """({fmt: [seconds at each of BATCHES]}, the format picked, rounds): the best times of the
    rounds, once a round leaves the pick from them as it was. The formats take turns within a
    round, so a load that comes and goes slows them alike. The pick is made from the best times,
    the figures kept: each round's own pick could settle on a format that the kept figures put
    further than MARGIN behind the fastest."""
    best, previous = None, None
    for round_number in range(1, MAX_ROUNDS + 1):
        timings = one_round(model, formats, device)
        best = timings if best is None else {fmt: list(map(min, best[fmt], timings[fmt])) for fmt in formats}
        pick = clear_pick(best)
        if pick == previous:
            return best, pick, round_number
        previous = pick
    raise Unmeasured(f"the weight formats' timings did not agree in {MAX_ROUNDS} rounds: the CPUs were busy; start again when they are not")


def clear_pick(timings):
    """The fastest format; among formats within MARGIN of it, the first in the order given (the
    least perplexed first: measure), so that a near tie decided by noise picks the same format
    every round."""
    fastest = min(score(times) for times in timings.values())
    return next(fmt for fmt, times in timings.items() if score(times) <= (1 + MARGIN) * fastest)


def one_round(model, formats, device, repeats=5):
    return {fmt: [linears_time(LlamaWeights.of(model, fmt), batch, model, device, repeats) for batch in BATCHES] for fmt in formats}


@torch.inference_mode()
def linears_time(weights, batch, model, device, repeats=5):
    """The best of a few passes through every linear layer at `batch` tokens."""
    layers = weights.linears()
    inputs = {size: torch.randn(batch, size, dtype=model.dtype, device=device) for size in {layer.in_features for layer in layers}}
    best = math.inf
    for _ in range(repeats + 1):  # the first pass warms the kernels up
        start = time.perf_counter()
        for layer in layers:
            layer(inputs[layer.in_features])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best
