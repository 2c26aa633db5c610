#!/usr/bin/env bash
# Static checks that fail `make test`: ruff lint, ruff format and mypy over the
# engine, the operator and the test bed package.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"
rc=0
"$VENV/bin/ruff" check . || rc=1
"$VENV/bin/ruff" format --check . || rc=1
"$VENV/bin/mypy" engine/slimspec operator/slimspec_operator scripts/testbed/slimspec_testbed || rc=1
exit $rc
