#!/usr/bin/env bash
# Keeps the chart's CRDs identical to the source of truth:
#   crds/*.yaml  ->  charts/slimspec/crds/*.yaml
# (slimspecservice.yaml: the SlimSpecService CRD; kopf-peering.yaml: Kopf's
# peering CRDs, used when operator.peering.enabled.) Helm installs the files in
# a chart's crds/ folder before the templates and never templates them, so the
# copies must be byte-for-byte the same files.
#   bash scripts/sync-chart-crd.sh          copy them
#   bash scripts/sync-chart-crd.sh --check  exit 1 if the copies differ (CI, tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/crds"
DST="$ROOT/charts/slimspec/crds"

if [[ ! -f "$SRC/slimspecservice.yaml" ]]; then
  echo "missing $SRC/slimspecservice.yaml" >&2
  exit 2
fi
if [[ "${1:-}" == "--check" ]]; then
  if diff -r "$SRC" "$DST" >/dev/null; then
    echo "chart CRDs in sync"
    exit 0
  fi
  echo "charts/slimspec/crds/ differs from crds/: run bash scripts/sync-chart-crd.sh" >&2
  diff -ru "$DST" "$SRC" >&2 || true
  exit 1
fi
mkdir -p "$DST"
find "$DST" -maxdepth 1 -name '*.yaml' -delete
cp "$SRC"/*.yaml "$DST"/
echo "copied $SRC/*.yaml -> $DST/"
