"""The compiled step saved once per machine and loaded by later starts (torch's AOT precompile).

Through `torch.compile`, a start traces the step's Python again (about 6 s here, 25 s the first
time) and every step first checks the program's guards (about 1 ms of a 10 ms step at one
sequence). Precompiled (`aot_compile`), the program is traced once, saved with a reference to
its kernels in the compile cache, loaded in about a second, and called without guards: every
step gives it the same kinds of tensors, and the sizes that change are symbolic in it. A saved
program is keyed by everything it was compiled for (compiled.CompiledStep.key); one that will
not load is compiled again.
"""

import copyreg
import logging
import time
import types
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_programs = {}  # key -> program, for every engine of this process


def available(program):
    return hasattr(program, "aot_compile")  # torch 2.10 and later


def program(key, compile_program, cache_dir, f_globals):
    """This process's program for `key`, the one saved under `cache_dir`, or `compile_program()`
    now (saved there, where there is a `cache_dir`)."""
    if key in _programs:
        return _programs[key]
    path = Path(cache_dir) / f"step-{key}.bin" if cache_dir is not None else None
    loaded = load(path, f_globals) if path is not None and path.is_file() else None
    if loaded is not None:
        log.info("compiled step: loaded %s", path)
    else:
        start = time.monotonic()
        loaded = compile_program()
        saved = path is not None and save(loaded, path)
        log.info("compiled step: compiled in %.0f s%s", time.monotonic() - start, f", saved as {path}" if saved else "")
    loaded.disable_guard_check()
    _programs[key] = loaded
    return loaded


def save(program, path):
    """Whether it was saved: a start that cannot write its data directory still runs compiled."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        program.save_compiled_function(str(path))  # written whole or not at all
    except OSError as exc:
        log.warning("the compiled step was not saved (the next start compiles it again): %s", exc)
        return False
    return True


@contextmanager
def plain_pickling():
    """Compiling pickles parts of the program as it goes, and saving pickles the rest: without
    the reducers Twisted registers for every pickler (Daphne brings it into every process of
    the site), whose way with a class's method saves the method's metaclass, and the program
    would not load again."""
    kinds = (types.MethodType, types.FunctionType, types.ModuleType)
    taken = {kind: copyreg.dispatch_table.pop(kind) for kind in kinds if kind in copyreg.dispatch_table}
    try:
        yield
    finally:
        copyreg.dispatch_table.update(taken)


def load(path, f_globals):
    from torch._dynamo.aot_compile import AOTCompiledFunction

    try:
        return AOTCompiledFunction.deserialize(path.read_bytes(), f_globals=f_globals)
    except Exception as exc:  # written by another torch, or its kernels were cleared: compile again
        log.warning("the saved compiled step %s did not load, compiling it again: %s", path.name, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def compiler(program, args):
    """A function that precompiles `program` for arguments like `args`."""

    def compile_program():
        with torch.inference_mode(), torch.fx.experimental._config.patch(backed_size_oblivious=True, use_duck_shape=False):
            return program.aot_compile((args, {}))

    return compile_program
