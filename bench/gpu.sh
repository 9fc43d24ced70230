#!/bin/sh
# The engine alone on a GPU machine where only Python, torch and transformers are installed:
# greedy equality with `generate`, then tokens/s at 1, 32, 128 and 256 sequences (bench/gpu.py).
# Add --cpu to check it here first. Stops itself after 290 s: a GPU lease is short.
set -e
cd "$(dirname "$0")/.."
exec timeout 290 "${PYTHON:-python3}" bench/gpu.py "$@"
