#!/usr/bin/env bash
# Builds the kube-apiserver of the oldest Kubernetes the chart supports
# (K8S_FLOOR_VERSION in versions.sh) into $SLIMSPEC_CACHE/k8s/<version>/, the
# same way install.sh builds the current one: a scratch Go module requiring
# k8s.io/kubernetes with every staging module pinned, built with CGO off and
# the version stamped in. Only the API server: the floor tests install the CRD
# and check its validation, which needs no controllers. That Kubernetes needs
# an older Go, which GOTOOLCHAIN fetches through the module proxy.
# Idempotent: skipped when the cached binary reports the version.
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/versions.sh"

VERSION="$K8S_FLOOR_VERSION"
OUT_DIR="$SLIMSPEC_CACHE/k8s/$VERSION"

exec 8>"$SLIMSPEC_CACHE/.testbed-floor.lock"
flock 8

source "$(dirname "${BASH_SOURCE[0]}")/k8s-build.sh"
export GOTOOLCHAIN="${SLIMSPEC_FLOOR_GOTOOLCHAIN:-$K8S_FLOOR_GOTOOLCHAIN}"

floor_ok() {
  [[ -x "$OUT_DIR/kube-apiserver" ]] &&
    "$OUT_DIR/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes $VERSION"
}

build_floor_apiserver() {
  if floor_ok; then echo "cached: $OUT_DIR/kube-apiserver"; return 0; fi
  command -v go >/dev/null 2>&1 || { echo "go not found (needed to fetch $GOTOOLCHAIN)" >&2; return 1; }
  local src="$SLIMSPEC_CACHE/k8s/src-$VERSION"
  rm -rf "$src"
  write_k8s_module "$src" "$VERSION" "$K8S_FLOOR_GO_DIRECTIVE" "$K8S_FLOOR_STAGING_VERSION" \
    kube-apiserver
  rm -rf "$OUT_DIR.tmp" && mkdir -p "$OUT_DIR.tmp"
  go build -trimpath -ldflags "$(k8s_ldflags "$VERSION")" -o "$OUT_DIR.tmp/" k8s.io/kubernetes/cmd/kube-apiserver
  rm -rf "$OUT_DIR" && mv "$OUT_DIR.tmp" "$OUT_DIR"
  floor_ok
  if [[ "${SLIMSPEC_TESTBED_PRUNE_GO:-0}" == 1 ]]; then go clean -cache; fi
}

step "kube-apiserver $VERSION, the supported floor (go build, $GOTOOLCHAIN)" build_floor_apiserver
