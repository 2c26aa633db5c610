# Shared shell helpers for the project's scripts. Source it; do not run it.
# Everything heavy (venv packages' download cache, Kubernetes binaries, helm,
# Prometheus, model weights) is cached outside the repository under
# $SLIMSPEC_CACHE so a second run, or a fresh clone, reuses it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export REPO_ROOT
export SLIMSPEC_CACHE="${SLIMSPEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/slimspec}"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$SLIMSPEC_CACHE/uv}"
VENV="${SLIMSPEC_VENV:-$REPO_ROOT/.venv}"
export VENV
mkdir -p "$SLIMSPEC_CACHE"

# step NAME CMD...: run a set-up step and print how long it took, so slow
# steps are visible in CI logs.
step() {
  local name="$1"; shift
  local t0=$SECONDS
  echo "==> $name"
  # Explicit status: a caller's `step ... || rc=$?` turns set -e off in here, and a
  # bare "$@" followed by echo would then return 0 for a failed step.
  local status=0
  "$@" || status=$?
  if ((status != 0)); then
    echo "<== $name FAILED (exit $status) after $((SECONDS - t0))s"
    return "$status"
  fi
  echo "<== $name took $((SECONDS - t0))s"
}
