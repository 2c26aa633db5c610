#!/usr/bin/env bash
# Re-pin every dependency set after editing engine/pyproject.toml,
# operator/pyproject.toml, scripts/testbed/pyproject.toml or requirements-dev.in.
# Then run scripts/bootstrap.sh.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"
uv pip compile -q --python-version 3.11 engine/pyproject.toml -o engine/requirements.lock
uv pip compile -q --python-version 3.11 operator/pyproject.toml -o operator/requirements.lock
uv pip compile -q --python-version 3.11 engine/pyproject.toml operator/pyproject.toml \
  scripts/testbed/pyproject.toml requirements-dev.in -o requirements-dev.lock
