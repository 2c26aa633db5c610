#!/usr/bin/env bash
# Keeps the chart's copy of the CRD identical to the source of truth:
#   crds/slimspecservice.yaml  ->  charts/slimspec/crds/slimspecservice.yaml
# Helm installs files in a chart's crds/ folder before the templates (and never
# templates them), so the copy must be byte-for-byte the same file.
#   bash scripts/sync-chart-crd.sh          copy it
#   bash scripts/sync-chart-crd.sh --check  exit 1 if the copy differs (CI, tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/crds/slimspecservice.yaml"
DST="$ROOT/charts/slimspec/crds/slimspecservice.yaml"

if [[ ! -f "$SRC" ]]; then
  echo "missing $SRC" >&2
  exit 2
fi
if [[ "${1:-}" == "--check" ]]; then
  if cmp -s "$SRC" "$DST"; then
    echo "chart CRD in sync"
    exit 0
  fi
  echo "charts/slimspec/crds/slimspecservice.yaml differs from crds/slimspecservice.yaml:" \
    "run bash scripts/sync-chart-crd.sh" >&2
  diff -u "$DST" "$SRC" >&2 || true
  exit 1
fi
mkdir -p "$(dirname "$DST")"
cp "$SRC" "$DST"
echo "copied $SRC -> $DST"
