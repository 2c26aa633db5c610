"""Cumulative decoder statistics (torch-free, cheap to read from the server)."""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from slimspec.decoding.types import RequestStats


def add_per_position(acc: list[int], counts: list[int] | int, upto: int | None = None) -> None:
    """acc[i] += counts[i] (or += 1 for i < upto when counts is an int flag)."""
    if isinstance(counts, int):
        n = upto or 0
        while len(acc) < n:
            acc.append(0)
        for i in range(n):
            acc[i] += counts
        return
    while len(acc) < len(counts):
        acc.append(0)
    for i, c in enumerate(counts):
        acc[i] += c


@dataclass
class DecoderStats:
    """Totals over the decoder's life. Read-only for callers; the decoder updates it."""

    requests_finished: int = 0
    generated_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # per-request verifications (a batched step of B rows counts B)
    batch_steps: int = 0  # batched speculative steps
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    prefill_time_s: float = 0.0
    fused_prefills: int = 0  # requests whose target prefill rode on a verification forward
    draft_forwards: int = 0
    sibling_hits: int = 0  # verifications where a sibling draft (siblings.py) was accepted
    target_forwards: int = 0
    # lookup drafts (lookup.py): their steps' verifications, tokens proposed and kept;
    # not in drafted / accepted / verify_steps, which are the draft model's
    lookup_verifications: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    # the prefix cache (prefix_cache.py): prompts looked up, those that hit, prompt tokens
    # whose prefill was skipped, blocks evicted; bytes and blocks held now
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    prefix_evictions: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_blocks: int = 0
    prefix_store_s: float = 0.0  # copying prompts' blocks into the cache
    fallbacks: Counter = field(default_factory=Counter)  # reason -> count
    kept_acceptance: float | None = None  # latest shadow-check estimate (compressed / full head)
    shadow_samples: int = 0
    recent_accepted_lengths: deque = field(default_factory=lambda: deque(maxlen=256))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification (accepted + 1), over the decoder's life."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def recent_mean_accepted_length(self) -> float:
        """Same over the last 256 verifications (the gauge the server exports)."""
        with self._lock:
            vals = list(self.recent_accepted_lengths)
        return sum(vals) / len(vals) if vals else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=False)
        ]

    @property
    def draft_target_time_ratio(self) -> float:
        """Mean draft forward time / mean target verify forward time."""
        if not self.draft_forwards or not self.target_forwards or self.target_time_s <= 0:
            return 0.0
        return (self.draft_time_s / self.draft_forwards) / (
            self.target_time_s / self.target_forwards
        )

    def record_fallback(self, reason: str) -> None:
        with self._lock:
            self.fallbacks[reason] += 1

    def record_verification(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.drafted += drafted
            self.accepted += accepted
            self.verify_steps += 1
            add_per_position(self.drafted_per_position, 1, drafted)
            add_per_position(self.accepted_per_position, 1, accepted)
            self.recent_accepted_lengths.append(accepted + 1)

    def record_lookup(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.lookup_verifications += 1
            self.lookup_drafted += drafted
            self.lookup_accepted += accepted

    def as_dict(self) -> dict:
        return {
            "requests_finished": self.requests_finished,
            "generated_tokens": self.generated_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "verify_steps": self.verify_steps,
            "batch_steps": self.batch_steps,
            "mean_accepted_length": self.mean_accepted_length,
            "recent_mean_accepted_length": self.recent_mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "prefill_time_s": self.prefill_time_s,
            "fused_prefills": self.fused_prefills,
            "draft_target_time_ratio": self.draft_target_time_ratio,
            "fallbacks": dict(self.fallbacks),
            "kept_acceptance": self.kept_acceptance,
            "sibling_hits": self.sibling_hits,
            "lookup_verifications": self.lookup_verifications,
            "lookup_drafted": self.lookup_drafted,
            "lookup_accepted": self.lookup_accepted,
            "shadow_samples": self.shadow_samples,
            "prefix_lookups": self.prefix_lookups,
            "prefix_hits": self.prefix_hits,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_evictions": self.prefix_evictions,
            "prefix_cache_bytes": self.prefix_cache_bytes,
            "prefix_cache_blocks": self.prefix_cache_blocks,
            "prefix_store_s": self.prefix_store_s,
        }


def record_request_verification(stats: RequestStats, drafted: int, accepted: int) -> None:
    stats.drafted += drafted
    stats.accepted += accepted
    stats.verify_steps += 1
    add_per_position(stats.drafted_per_position, 1, drafted)
    add_per_position(stats.accepted_per_position, 1, accepted)
