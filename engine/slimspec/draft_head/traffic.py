"""The head follows the traffic: rank the vocabulary by the tokens the target emits.

The subset a ratio scores is a prefix of the head's ranking, ranked once on a
calibration corpus; on traffic unlike it (another language, prose) the tokens the
target emits fall outside the subset and acceptance at high ratios drops. So the
decoder counts what the target emits (a vocabulary-sized counter) and, at a lower
weight, the distinct tokens of each prompt it is given (a request's prompt shows the
vocabulary of its domain before a single token is emitted: identifiers and words are
largely copied from context), re-ranks in a background thread, and swaps the new head
in between two steps. Exactness is untouched: the target verifies every token whatever
the draft scores.

The new ranking blends the calibration ranking (a Zipf prior over its ranks, weighing
as much as PRIOR_TOKENS tokens of traffic) with the traffic counts (decayed with a
half-life, so the ranking follows what is served now); ties keep the current order, so
a re-rank moves only the tokens whose score moved (prefix-stable where possible).
Counts persist in the cache volume (traffic_store.py) for restarts and new replicas.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from slimspec.draft_head.head import DraftHead, inverse
from slimspec.draft_head.traffic_store import load_counts, save_counts

log = logging.getLogger("slimspec.ranking")

PRIOR_TOKENS = 20_000  # the calibration ranking weighs as much as this many traffic tokens
HALF_LIFE_TOKENS = 200_000  # traffic counts halve over this many newer tokens
RECENT_TOKENS = 2048  # the window coverage is measured on
MIN_NEW_TOKENS = 128  # new tokens counted before a re-rank (well before the guard's evidence)
EVERY_TOKENS = 8192  # re-rank (and persist) at least this often, coverage or not
COVERAGE_TRIGGER = 0.99  # re-rank early when coverage of the ratio in force falls below
MIN_INTERVAL_S = 2.0  # between two re-ranks
PROMPT_WEIGHT = 0.5  # a prompt token counts this much of an emitted one (evidence, not output)


def zipf_prior(ranking: torch.Tensor) -> torch.Tensor:
    """(V,) a probability per token id from a ranking alone: 1/(rank + 1), normalised
    (token frequencies of text follow it roughly; only the order matters much)."""
    v = ranking.shape[0]
    p = 1.0 / torch.arange(1, v + 1, dtype=torch.float64)
    out = torch.empty(v, dtype=torch.float64)
    out[ranking.cpu()] = p / p.sum()
    return out


def blended_ranking(
    prior: torch.Tensor,
    counts: torch.Tensor,
    current: torch.Tensor,
    first: Sequence[int] = (),
    prior_tokens: float = PRIOR_TOKENS,
) -> torch.Tensor:
    """(V,) token ids by blended score, best first: (1 - w) prior + w traffic share with
    w = n / (n + prior_tokens), n the (decayed) traffic token count. Ties keep their order
    in `current`; `first` (special tokens) stays in front."""
    current = current.cpu()
    n = float(counts.sum())
    w = n / (n + prior_tokens) if n > 0 else 0.0
    share = counts.double() / n if n > 0 else torch.zeros_like(prior)
    score = (1 - w) * prior + w * share
    order = torch.sort(-score[current], stable=True).indices
    ranking = current[order]
    forced = [t for t in dict.fromkeys(first) if 0 <= t < ranking.shape[0]]
    if forced:
        forced_t = torch.tensor(forced, dtype=torch.long)
        rest = ranking[~torch.isin(ranking, forced_t)]
        ranking = torch.cat([forced_t, rest])
    return ranking


def coverage(recent: torch.Tensor, rank_of: torch.Tensor, subset_size: int) -> float:
    """Share of the recent tokens inside the first `subset_size` of the ranking."""
    if recent.numel() == 0:
        return 1.0
    return float((rank_of[recent] < subset_size).double().mean())


def rerank_due(
    new_tokens: float,
    cover: float,
    seconds_since: float,
    running: bool,
    min_tokens: int = MIN_NEW_TOKENS,
    every_tokens: int = EVERY_TOKENS,
    min_interval_s: float = MIN_INTERVAL_S,
) -> bool:
    """Re-rank when no re-rank is running, enough new tokens were counted, and either the
    subset in force misses recent tokens or it is time for the periodic one."""
    if running or new_tokens < min_tokens or seconds_since < min_interval_s:
        return False
    return cover < COVERAGE_TRIGGER or new_tokens >= every_tokens


@dataclass(frozen=True)
class RankingStatus:
    source: str  # "calibration" | "traffic"
    built_at: float  # unix time of the data behind the ranking
    coverage: float  # of the recent tokens, by the subset in force
    reranks: int


class TrafficRanking:
    """Counts emitted tokens, re-ranks the head in the background, hands the new head to
    the decoder to swap between steps (take_ready), persists the counts."""

    def __init__(
        self,
        head: DraftHead,
        first: Sequence[int] = (),
        path: Path | None = None,
        built_at: float | None = None,
        enabled: bool = True,
    ) -> None:
        self.vocab = head.vocab
        self.enabled = enabled
        self.path = path
        self.first = list(first)
        self.prior = zipf_prior(head.ranking)
        self.counts = torch.zeros(self.vocab, dtype=torch.float64)
        self.recent: collections.deque[int] = collections.deque(maxlen=RECENT_TOKENS)
        self.source = "calibration"
        self.built_at = time.time() if built_at is None else built_at
        self.reranks = 0
        # when to re-rank (rerank_due); attributes so a test can make it eager
        self.min_new_tokens, self.every_tokens = MIN_NEW_TOKENS, EVERY_TOKENS
        self.min_interval_s = MIN_INTERVAL_S
        self.prior_tokens = PRIOR_TOKENS
        self._rank_of = inverse(head.ranking.cpu())
        self._new = 0.0  # (weighted) tokens counted since the last re-rank started
        self._last = -float("inf")
        self._thread: threading.Thread | None = None
        self._ready: tuple[DraftHead, float] | None = None
        self._lock = threading.Lock()
        if path is not None and enabled:
            loaded = load_counts(path, self.vocab)
            if loaded is not None:
                self.counts, saved_at = loaded
                self._ready = (self._build(head, self.counts), saved_at)
                log.info("head ranking from %d persisted traffic tokens (%s)", self.total, path)

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    def observe(self, tokens: Sequence[int]) -> None:
        """Count tokens the target emitted (step thread)."""
        ids = self._count(tokens, 1.0)
        if ids is not None:
            self.recent.extend(ids.tolist())  # coverage is of what the target emits

    def observe_prompt(self, tokens: Sequence[int]) -> None:
        """Count the distinct tokens of a new request's prompt, each once at PROMPT_WEIGHT
        (step thread): which words the domain uses, not how often the prompt repeats
        them, so a long prompt cannot crowd what the target emits out of a small subset."""
        self._count(list(dict.fromkeys(tokens)), PROMPT_WEIGHT)

    def _count(self, tokens: Sequence[int], weight: float) -> torch.Tensor | None:
        if not self.enabled or not tokens:
            return None
        ids = torch.tensor([t for t in tokens if 0 <= t < self.vocab], dtype=torch.long)
        if ids.numel() == 0:
            return None
        self.counts.index_add_(0, ids, torch.full((ids.numel(),), weight, dtype=torch.float64))
        self._new += weight * ids.numel()
        return ids

    def coverage(self, subset_size: int) -> float:
        recent = torch.tensor(list(self.recent), dtype=torch.long)
        return coverage(recent, self._rank_of, subset_size)

    def maybe_start(self, head: DraftHead, subset_size: int, now: bool = False) -> bool:
        """Start a background re-rank if one is due, or (now) on whatever was counted
        unless one is running (step thread); True if started."""
        if not self.enabled:
            return False
        running = self._thread is not None and self._thread.is_alive()
        if now and running:
            return False
        since = time.monotonic() - self._last
        cover = self.coverage(subset_size)
        if not now and not rerank_due(
            self._new,
            cover,
            since,
            running,
            self.min_new_tokens,
            self.every_tokens,
            self.min_interval_s,
        ):
            return False
        self.counts *= 0.5 ** (self._new / HALF_LIFE_TOKENS)
        snapshot = self.counts.clone()
        self._new, self._last = 0.0, time.monotonic()
        # Not a daemon: the interpreter's exit waits for the (seconds-long) build. A
        # daemon thread still inside torch when the process exits is torn down in C++
        # frames, and the process aborts (std::terminate, exit code 134).
        self._thread = threading.Thread(
            target=self._rerank, args=(head, snapshot), name="slimspec-rerank", daemon=False
        )
        self._thread.start()
        return True

    def _build(self, head: DraftHead, counts: torch.Tensor) -> DraftHead:
        ranking = blended_ranking(self.prior, counts, head.ranking, self.first, self.prior_tokens)
        return head.reranked(ranking)

    def _rerank(self, head: DraftHead, counts: torch.Tensor) -> None:
        try:
            with torch.inference_mode():
                new = self._build(head, counts)
        except Exception:  # a failed re-rank keeps the head in use; log it, never crash
            log.exception("re-ranking the head failed; keeping the current ranking")
            return
        taken = time.time()
        with self._lock:
            self._ready = (new, taken)
        if self.path is not None:
            try:
                save_counts(self.path, counts, taken)
            except OSError as exc:
                log.warning("could not persist traffic counts to %s: %s", self.path, exc)

    def take_ready(self) -> DraftHead | None:
        """The re-ranked head, once, when one is ready (step thread, between steps)."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None:
            return None
        head, built_at = ready
        self._rank_of = inverse(head.ranking.cpu())
        self.source, self.built_at = "traffic", built_at
        self.reranks += 1
        return head

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a running re-rank to finish (tests, shutdown)."""
        t = self._thread
        if t is not None:
            t.join(timeout)

    def status(self, subset_size: int) -> RankingStatus:
        return RankingStatus(self.source, self.built_at, self.coverage(subset_size), self.reranks)
