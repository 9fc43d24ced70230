#!/usr/bin/env bash
# Build llama.cpp's own OpenAI-compatible server (llama-server), the real upstream the relay
# tests run, into $1. PyPI carries no binary of it, so it is built from the llama.cpp sources
# in llama-cpp-python's source distribution (a pinned version), without its web UI and
# without TLS. Takes about 15-25 minutes on 2 cores, once: the Makefile keeps the result
# outside the checkout, so later runs on the machine (and fresh clones there) reuse it.
set -euo pipefail
out="$1"
version="$2"
python="${3:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF >"$work/cmake.log" 2>&1 || { cat "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j"$(nproc)" >"$work/build.log" 2>&1 || { tail -50 "$work/build.log" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
cp "$work/build/bin/llama-server" "$out.tmp"
mv "$out.tmp" "$out"
"$out" --version
