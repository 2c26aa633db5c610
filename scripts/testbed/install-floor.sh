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

export GOMODCACHE="$SLIMSPEC_CACHE/go/mod"
export GOCACHE="$SLIMSPEC_CACHE/go/build"
export GOFLAGS="-modcacherw -buildvcs=false"
export GOTOOLCHAIN="${SLIMSPEC_FLOOR_GOTOOLCHAIN:-$K8S_FLOOR_GOTOOLCHAIN}"
export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"
export CGO_ENABLED=0

floor_ok() {
  [[ -x "$OUT_DIR/kube-apiserver" ]] &&
    "$OUT_DIR/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes $VERSION"
}

build_floor_apiserver() {
  if floor_ok; then echo "cached: $OUT_DIR/kube-apiserver"; return 0; fi
  command -v go >/dev/null 2>&1 || { echo "go not found (needed to fetch $GOTOOLCHAIN)" >&2; return 1; }
  local src="$SLIMSPEC_CACHE/k8s/src-$VERSION" mod_file staging minor
  rm -rf "$src" && mkdir -p "$src"
  cd "$src"
  printf 'module slimspec.local/k8sfloor\n\ngo %s\n\nrequire k8s.io/kubernetes %s\n' \
    "$K8S_FLOOR_GO_DIRECTIVE" "$VERSION" >go.mod
  mod_file="$(go mod download -json "k8s.io/kubernetes@$VERSION" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')"
  staging="$(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$mod_file" | sort -u)"
  [[ -n "$staging" ]] || { echo "no staging modules found in $mod_file" >&2; return 1; }
  {
    echo
    echo "replace ("
    for m in $staging; do echo "	$m => $m $K8S_FLOOR_STAGING_VERSION"; done
    echo ")"
  } >>go.mod
  go get "k8s.io/kubernetes/cmd/kube-apiserver@$VERSION"
  minor="$(echo "$VERSION" | cut -d. -f2)"
  local pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$VERSION -X $pkg.gitMajor=1"
  ldflags+=" -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  rm -rf "$OUT_DIR.tmp" && mkdir -p "$OUT_DIR.tmp"
  go build -trimpath -ldflags "$ldflags" -o "$OUT_DIR.tmp/" k8s.io/kubernetes/cmd/kube-apiserver
  rm -rf "$OUT_DIR" && mv "$OUT_DIR.tmp" "$OUT_DIR"
  floor_ok
  if [[ "${SLIMSPEC_TESTBED_PRUNE_GO:-0}" == 1 ]]; then go clean -cache; fi
}

step "kube-apiserver $VERSION, the supported floor (go build, $GOTOOLCHAIN)" build_floor_apiserver
