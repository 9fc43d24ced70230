"""The compiled CPU step's attention: a C++ operator (paged_attention.cpp), built once per
machine with the C++ compiler that inductor uses too, and kept beside the compiled step.

Written as a gather and two sums (compiled.attend), inductor's loops cost about 48 us per row
and key of context on these CPUs, four times an eager decode at 2,000 tokens of context; the
operator reads each key once for the query heads that share it, in eight lanes, and keeps each
row's numbers its own (bench/step_shapes.py measures both).
"""

import hashlib
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_attention.cpp")
_loaded = []  # the library this process loaded


def load(cache_dir=None):
    """Registers torch.ops.tokstream.paged_attention in this process, building the library
    first where none is kept for this source, torch and CPU. Raises where the build fails."""
    if _loaded:
        return
    from .formats import cpu_description

    parts = [SOURCE.read_text(), torch.__version__, cpu_description(), os.environ.get("CXX", "g++")]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    path = Path(cache_dir or tempfile.gettempdir()) / f"paged_attention-{key}.so"
    if not path.is_file():
        build(path)
    torch.ops.load_library(str(path))
    torch.library.register_fake("tokstream::paged_attention")(shape_of)
    _loaded.append(path)


def shape_of(q, k_cache, v_cache, tables, positions, block_size):
    """What the operator returns, for the compiler: [rows, heads * dim] float32."""
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def build(path):
    from torch.utils import cpp_extension

    start = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    command = [
        os.environ.get("CXX", "g++"),
        *("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"),
        *(f"-I{include}" for include in cpp_extension.include_paths()),
        str(SOURCE),
        f"-L{cpp_extension.TORCH_LIB_PATH}",
        *("-lc10", "-ltorch_cpu"),
        "-o",
        str(partial),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    os.replace(partial, path)  # a start that looks meanwhile sees no library or the whole one
    log.info("paged attention: built in %.0f s, kept as %s", time.monotonic() - start, path)
