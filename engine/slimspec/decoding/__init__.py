"""Decoding: the speculative decoder and the pieces of its loop (draft, verify, sampling,
KV caches, adaptive k, quality control, statistics)."""

from slimspec.transformers_floor import require_transformers

require_transformers()
