#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (cached outside the repo),
# then pytest. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
t_all=$SECONDS
step "bootstrap venv" bash "$REPO_ROOT/scripts/bootstrap.sh"
TESTBED="$REPO_ROOT/scripts/testbed"
step "test bed tools (helm, Prometheus, etcd, container runtime packages)" \
  bash "$TESTBED/install.sh" helm prometheus etcd runtime

# The Go builds (Kubernetes control plane, node and floor API server, Prometheus) are
# CPU-bound; the image builds mostly download and write layers: on a fresh machine
# they overlap.
go_and_images() {
  local log="$SLIMSPEC_CACHE/go-builds.log" pid rc=0
  { bash "$TESTBED/install.sh" k8s node prometheus-sd keda && bash "$TESTBED/install-floor.sh"; } \
    >"$log" 2>&1 &
  pid=$!
  bash "$TESTBED/images.sh" build --without-prometheus || rc=$?
  wait "$pid" || rc=$?
  sed 's/^/  [go builds] /' "$log"
  return "$rc"
}
step "Go builds (Kubernetes incl. the floor API server, Prometheus, KEDA) beside the image builds" \
  go_and_images
step "Prometheus and KEDA images" bash "$TESTBED/images.sh"
step "images into the real node's containerd (by content tag)" bash "$TESTBED/node.sh" import
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
