#!/usr/bin/env bash
# llama.cpp for bench/peers.py, built once from the pinned llama-cpp-python sdist (PyPI
# ships its vendored llama.cpp source; no other download) and cached outside the repo:
# $SLIMSPEC_CACHE/llamacpp/<version>/bin/llama-server (target-only, speculative with -md,
# and continuous batching with -np: every llama.cpp row of the bench).
# Native CPU flags (GGML_NATIVE): the cache is per machine, as the benchmark is.
# Prints the bin directory on its last line. LLAMA_CPP_SDIST: use that downloaded sdist.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.16}"
DEST="$SLIMSPEC_CACHE/llamacpp/$VERSION"
TARGETS=(llama-server)
if [[ -x "$DEST/bin/llama-server" ]]; then
  echo "$DEST/bin"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [[ -n "${LLAMA_CPP_SDIST:-}" ]]; then  # an sdist of this version fetched before
  cp "$LLAMA_CPP_SDIST" "$work/"
else
  python3 -m pip download --quiet --no-deps --no-binary :all: -d "$work" \
    "llama-cpp-python==$VERSION" >&2
fi
tar -C "$work" -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" --target "${TARGETS[@]}" -j "$(nproc)" >&2
mkdir -p "$DEST.tmp/bin"
for t in "${TARGETS[@]}"; do cp "$work/build/bin/$t" "$DEST.tmp/bin/"; done
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "$DEST/bin"
