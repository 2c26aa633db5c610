#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (cached outside the repo),
# then pytest. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
t_all=$SECONDS
step "bootstrap venv" bash "$REPO_ROOT/scripts/bootstrap.sh"
step "test bed binaries (Kubernetes control plane + node, etcd, helm, Prometheus, runtime)" \
  bash "$REPO_ROOT/scripts/testbed/install.sh"
step "images (Debian base, engine, operator, pause, Prometheus; cached by content)" \
  bash "$REPO_ROOT/scripts/testbed/images.sh"
step "images into the real node's containerd (by content tag)" \
  bash "$REPO_ROOT/scripts/testbed/node.sh" import
step "linters (checkov, own pinned venv)" bash "$REPO_ROOT/scripts/install-linters.sh"
step "real model pair (fetch, verify, convert)" \
  "$VENV/bin/slimspec" fetch --pair default
step "small real model (SmolLM2-135M, for server and tuning tests)" \
  "$VENV/bin/slimspec" fetch --model smollm2-135m-instruct
cd "$REPO_ROOT"
rc=0
# Lint failures fail the run, but pytest still runs so one CI log shows both.
step "static checks (ruff, ruff format, mypy)" bash "$REPO_ROOT/scripts/lint.sh" || rc=$?
step "pytest" "$VENV/bin/python" -m pytest "$@" || rc=$?
echo "total test command time: $((SECONDS - t_all))s"
exit $rc
