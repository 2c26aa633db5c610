#!/usr/bin/env bash
# Create the project's virtualenv (.venv in the checkout) from the pinned lock
# file, with uv, and install both distributions (engine, operator) and the
# development test bed (scripts/testbed, shared by tests/ and bench/) editable.
# Idempotent: a venv whose lock hash matches is reused as is.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ensure_uv() {
  if ! command -v uv >/dev/null 2>&1; then
    local tools="$SLIMSPEC_CACHE/tools/uv"
    if [ ! -x "$tools/bin/uv" ]; then
      python3 -m venv "$tools"
      "$tools/bin/pip" install -q "uv==0.13.8"
    fi
    export PATH="$tools/bin:$PATH"
  fi
}

make_venv() {
  local want
  want="$(cat "$REPO_ROOT/requirements-dev.lock" "$REPO_ROOT/engine/pyproject.toml" \
          "$REPO_ROOT/operator/pyproject.toml" "$REPO_ROOT/scripts/testbed/pyproject.toml" \
          | sha256sum | cut -c1-16)"
  if [ -f "$VENV/.slimspec-lock" ] && [ "$(cat "$VENV/.slimspec-lock")" = "$want" ]; then
    echo "venv up to date ($VENV)"
    return
  fi
  uv venv --python python3.11 --allow-existing "$VENV"
  uv pip sync --python "$VENV/bin/python" "$REPO_ROOT/requirements-dev.lock"
  uv pip install --python "$VENV/bin/python" --no-deps \
    -e "$REPO_ROOT/engine" -e "$REPO_ROOT/operator" -e "$REPO_ROOT/scripts/testbed"
  echo "$want" > "$VENV/.slimspec-lock"
}

step "uv" ensure_uv
step "python venv (pinned lock)" make_venv
