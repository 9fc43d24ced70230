"""The engine's C++ operators for the CPU, built once per machine with the C++ compiler that
inductor uses too, and kept beside the compiled step:

- paged_attention.cpp, the compiled step's attention. Written as a gather and two sums
  (compiled.attend), inductor's loops cost about 48 us per row and key of context on these
  CPUs, four times an eager decode at 2,000 tokens of context; the operator scores eight keys
  at a time, reads each key from memory once for the query heads that share it, and keeps each
  row's numbers its own.
- quantized_linear.cpp, the int8 and int4 weight formats' matrix products (llama.OwnInt8,
  llama.OwnInt4), eager and compiled: activations rounded to int8 in groups of 32 and integer
  multiply-adds against weights laid out a block of eight outputs to a vector, as llama.cpp
  computes; torch's kernels convert every activation to bfloat16 and multiply in floats.

Both include lanes.h: eight float32 lanes, AVX2 where the compiler targets it, else plain C++,
whose sums across lanes run in one fixed tree. bench/step_shapes.py and bench/linears.py measure
the operators against what they replace; bench/operators_ab.py a change to them against a
commit, both built into one process.
"""

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "quantized_linear.cpp")]
HEADERS = [Path(__file__).with_name("lanes.h")]  # included by the sources: part of the library's key
BLOCK = 8  # outputs the linear operators compute together, one to a lane: their weights' layout
_loaded = []  # the library this process loaded, or the error its build gave


def load(cache_dir=None):
    """Registers the operators in this process (torch.ops.tokstream), building the library first
    where none is kept for these sources, torch and CPU. Raises where the build fails (and
    again at every later call: a process tries once)."""
    if not _loaded:
        try:
            _loaded.append(library(cache_dir))
        except Exception as exc:
            _loaded.append(exc)
    if isinstance(_loaded[0], Exception):
        raise _loaded[0]


def available(cache_dir=None):
    """Whether the operators are loaded, building them now where they were not tried yet; a
    failed build is logged once."""
    try:
        load(cache_dir)
    except Exception as exc:
        if len(_loaded) == 1:
            _loaded.append("logged")
            log.warning("CPU operators: none in this process, torch's kernels serve: %s", str(exc).splitlines()[0])
        return False
    return True


def cpu_description():
    """The CPU and its instruction sets, as far as this machine says."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu += Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
    except (OSError, IndexError):
        pass
    return cpu


def key():
    parts = [*(source.read_text() for source in SOURCES + HEADERS), torch.__version__, cpu_description(), os.environ.get("CXX", "g++")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def library(cache_dir):
    path = Path(cache_dir or Path(tempfile.gettempdir()) / "tokstream") / f"cpu_ops-{key()}.so"
    if not path.is_file():
        build(path)
    torch.ops.load_library(str(path))
    torch.library.register_fake("tokstream::paged_attention")(attention_shape)
    torch.library.register_fake("tokstream::int8_linear")(linear_shape)
    torch.library.register_fake("tokstream::int4_linear")(linear_shape)
    return path


def attention_shape(q, k_cache, v_cache, tables, positions, block_size):
    """What the attention returns, for the compiler: [rows, heads * dim] float32."""
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def linear_shape(x, weight, *scales):
    """What a product returns: [rows, outputs] float32 (weight: [outputs / BLOCK, ...])."""
    return x.new_empty(x.shape[0], weight.shape[0] * BLOCK)


def build(path, sources=None):
    """Compiles `sources` (the operators' own: SOURCES) into the library at `path`."""
    from torch.utils import cpp_extension

    start = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [
        os.environ.get("CXX", "g++"),
        *("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"),
        *(f"-I{include}" for include in cpp_extension.include_paths()),
        *map(str, sources or SOURCES),
        f"-L{cpp_extension.TORCH_LIB_PATH}",
        *("-lc10", "-ltorch_cpu"),
        "-o",
        str(partial),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the CPU operators failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    os.replace(partial, path)  # a start that looks meanwhile sees no library or the whole one
    log.info("CPU operators: built in %.0f s, kept as %s", time.monotonic() - start, path)
