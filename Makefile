SHELL := /bin/bash
.PHONY: run test test-fast lint bench

# Serve the default real model pair locally on :8080 (no cluster needed).
run:
	bash scripts/run-local.sh

# The full test suite, set-up included (what CI runs).
test:
	bash scripts/test.sh

# Quick loop: skip the slow real-model suites.
test-fast:
	bash scripts/test.sh -m "not slow"

lint:
	bash scripts/lint.sh
