"""Rollouts: the pure plan and manifests, and the thin reconcile and Kopf handlers.

Never imports tuning (tests/test_import_contracts.py checks it).
"""
