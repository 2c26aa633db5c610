"""Kubernetes API: the operator's one client, ownership checks and status conditions."""
