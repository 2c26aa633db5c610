"""Tuning of the compression ratio and replica autoscaling: pure decisions, their
plan, one tick's I/O and the Kopf timer."""
