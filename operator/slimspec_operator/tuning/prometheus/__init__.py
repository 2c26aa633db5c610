"""Prometheus: the query registry (pure), the HTTP client and its credentials."""
