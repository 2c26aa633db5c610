"""The rows of the batch: admission, prefill, padding, appending tokens, results.

Invariants per row: the target cache holds seq[:-1] (the last token is always the
first input of the next verification); the draft cache holds seq[w:draft_seen], where w
is the start of its prompt window (draft_context.py; 0 with the whole prompt).

With a prefix cache (prefix_cache.py), a new prompt's caches start from the longest
stored prefix of prompt[:-1] and only the rest is prefilled (chunked, or riding on the
verification); every prompt's full blocks are stored once both models' caches hold
them (the target's alone where the draft prefills only a window: it then prefills its
window again after a hit).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slimspec.decoding.adaptive import AcceptanceEstimate
from slimspec.decoding.draft_context import window_start
from slimspec.decoding.grouped_forward import Group, forward_groups
from slimspec.decoding.kv import BatchKV, fill_caches
from slimspec.decoding.lookup import NgramIndex
from slimspec.decoding.prefix_cache import PrefixCache
from slimspec.decoding.sampling import BatchSampling
from slimspec.decoding.stats import DecoderStats, record_request_verification
from slimspec.decoding.types import (
    GenerationRequest,
    GenerationResult,
    RequestStats,
    StepOutput,
    TokenLogprob,
)


@dataclass
class Row:
    req: GenerationRequest
    seq: list[int]
    n_prompt: int
    draft_seen: int
    stats: RequestStats = field(default_factory=RequestStats)
    seed: int | None = None  # sampling rows only; randomness is keyed by (seed, position)
    est: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    idle_steps: int = 0  # consecutive steps without a draft (k = 0, or lookup drafts)
    logprobs: list[TokenLogprob] | None = None  # per output token, when the request asked
    ngrams: NgramIndex = field(default_factory=NgramIndex)  # lookup drafts' index of seq

    @classmethod
    def unstarted(cls, req: GenerationRequest) -> Row:
        """A request that finishes before it joins the batch (cancelled, or no tokens)."""
        return cls(req, list(req.prompt_ids), len(req.prompt_ids), 0)

    @property
    def output(self) -> list[int]:
        return self.seq[self.n_prompt :]


@dataclass
class PrefillJob:
    """A request whose prompt is being prefilled, possibly over several steps (its own
    caches until it joins the batch)."""

    req: GenerationRequest
    done: int = 0  # tokens of prompt[:-1] already in kv_t / kv_d
    cached: int = 0  # of them, tokens that came from the prefix cache
    kv_t: BatchKV | None = None
    kv_d: BatchKV | None = None
    seconds: float = 0.0
    draft_done: int = 0  # kv_d holds prompt[window start:draft_done]

    @property
    def remaining(self) -> int:
        return len(self.req.prompt_ids) - 1 - self.done


@dataclass(frozen=True)
class RowOutcome:
    """What one verification gives a row: the tokens to emit, how many drafts the target
    accepted, and whether the sibling at the break was accepted too."""

    emitted: list[int]
    accepted: int
    sibling_hit: bool
    logprobs: list[TokenLogprob] | None = None  # per emitted token, when the row asked


def right_aligned(
    seqs: Sequence[Sequence[int]], starts: Sequence[int], min_width: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, positions, real) (B, width) for token runs of different lengths, right-aligned.

    Row i's tokens sit at positions starts[i], starts[i] + 1, ...; the left padding
    (position starts[i]) is marked not real, so it becomes holes that cost compute but
    never influence attention.
    """
    width = max(min_width, max(len(s) for s in seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    pos = torch.zeros(len(seqs), width, dtype=torch.long)
    real = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (toks, start) in enumerate(zip(seqs, starts, strict=True)):
        m = len(toks)
        pos[i, :] = start
        if m:
            ids[i, width - m :] = torch.tensor(list(toks))
            pos[i, width - m :] = torch.arange(start, start + m)
            real[i, width - m :] = True
    return ids, pos, real


class RowBatch:
    """The requests being decoded together, and the target's and draft's KV caches.

    Requests queue from any thread (add, cancel); the step thread admits them (admit),
    advances the rows after each verification (advance) and keeps the results until
    they are popped.
    """

    def __init__(
        self,
        target_base: Any,
        draft_base: Any,
        device: torch.device,
        max_positions: int | None,
        prefill_batch: int,
        prefill_chunk: int = 512,
        fuse_prefill: bool = False,
        prefix_cache: PrefixCache | None = None,
        draft_context: int = 0,
    ) -> None:
        self.rows: list[Row] = []
        # A joining row's acceptance estimate (the decoder seeds it with what it measured)
        self.acceptance_prior: Callable[[], AcceptanceEstimate] = AcceptanceEstimate
        self.target_kv = BatchKV(device)
        self.draft_kv = BatchKV(device)
        self.results: dict[str, GenerationResult] = {}
        self.device = device
        self.max_positions = max_positions
        self._target_base, self._draft_base = target_base, draft_base
        self._prefill_batch = prefill_batch
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        self.prefill_chunk = prefill_chunk  # most prompt tokens prefilled per step
        # Whole prompts' target prefill rides on the verification when rows are decoding
        # (the target must be grouped_forward-enabled; no sibling drafts).
        self.fuse_prefill = fuse_prefill
        self.riding: list[Group] = []  # target prefill of the last n_riding rows
        self._riding_base: list[int] = []  # per riding group: cache slots before its prompt
        self.prefix_cache = prefix_cache  # None: off
        self.draft_context = draft_context  # the draft's prompt window (0: whole prompts)
        self._evictions_seen = 0
        self._store_s = 0.0  # storing blocks since the last admission
        self._prefilling: deque[PrefillJob] = deque()
        self.admitted: list[GenerationRequest] = []  # admitted by the last admit()
        self._queue_lock = threading.Lock()
        self._pending: deque[GenerationRequest] = deque()
        self._cancelled: set[str] = set()

    # ----------------------------------------------------------------- any thread
    def add(self, req: GenerationRequest, vocab: int) -> None:
        """Queue a request (it joins at the next step); ValueError for one that cannot run."""
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if req.max_new_tokens < 0:
            raise ValueError(f"request {req.request_id}: max_new_tokens must be >= 0")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {req.request_id}: token ids out of range: {bad[:5]}")
        with self._queue_lock:
            self._pending.append(req)

    def cancel(self, request_id: str) -> None:
        with self._queue_lock:
            self._cancelled.add(request_id)

    def has_work(self) -> bool:
        with self._queue_lock:
            return bool(self.rows or self._pending or self._prefilling)

    # ----------------------------------------------------------------- step thread
    def admit(self, stats: DecoderStats) -> list[StepOutput]:
        """Apply cancellations, then prefill the queued requests and add them as rows."""
        outputs: list[StepOutput] = []
        with self._queue_lock:
            cancelled, self._cancelled = self._cancelled, set()
            new = [r for r in self._pending if r.request_id not in cancelled]
            dropped = [r for r in self._pending if r.request_id in cancelled]
            self._pending.clear()
        for req in dropped:
            outputs.append(StepOutput(req.request_id, [], True, "cancelled"))
            self._finish(Row.unstarted(req), "cancelled", stats)
        if cancelled:
            keep = [i for i, row in enumerate(self.rows) if row.req.request_id not in cancelled]
            for row in self.rows:
                if row.req.request_id in cancelled:
                    outputs.append(StepOutput(row.req.request_id, [], True, "cancelled"))
                    self._finish(row, "cancelled", stats)
            self._keep(keep)
            for job in [j for j in self._prefilling if j.req.request_id in cancelled]:
                self._prefilling.remove(job)
                outputs.append(StepOutput(job.req.request_id, [], True, "cancelled"))
                self._finish(Row.unstarted(job.req), "cancelled", stats)
        todo: list[GenerationRequest] = []
        for req in new:
            if req.max_new_tokens == 0:
                outputs.append(StepOutput(req.request_id, [], True, "length"))
                self._finish(
                    Row(req, list(req.prompt_ids), len(req.prompt_ids), 0), "length", stats
                )
            else:
                todo.append(req)
        self.admitted = todo
        todo.sort(key=lambda r: len(r.prompt_ids))  # similar lengths together: less padding
        self._prefilling.extend(self._new_job(r, stats) for r in todo)
        self._prefill_within_budget(stats)
        self._prefix_stats(stats)
        return outputs

    def _new_job(self, req: GenerationRequest, stats: DecoderStats) -> PrefillJob:
        """A prefill job, its caches started from the longest cached prefix of prompt[:-1]."""
        job = PrefillJob(req)
        if self.prefix_cache is None:
            return job
        t0 = time.perf_counter()
        hit = self.prefix_cache.lookup(req.prompt_ids[:-1])
        stats.prefix_lookups += 1
        if hit.target is not None and (hit.draft is not None or self.draft_context):
            job.kv_t = BatchKV.from_slots(self.device, self._target_base.config, hit.target)
            if hit.draft is not None and not self.draft_context:
                job.kv_d = BatchKV.from_slots(self.device, self._draft_base.config, hit.draft)
                job.draft_done = hit.tokens
            else:  # the draft prefills its window with the rest (_draft_prefill)
                job.kv_d = BatchKV(self.device)
            job.done = job.cached = hit.tokens
            stats.prefix_hits += 1
            stats.prefix_hit_tokens += hit.tokens
        elapsed = time.perf_counter() - t0
        job.seconds += elapsed
        stats.prefill_time_s += elapsed
        return job

    def _prefix_stats(self, stats: DecoderStats) -> None:
        if self.prefix_cache is None:
            return
        now = self.prefix_cache.stats()
        stats.prefix_evictions += max(0, now.evictions - self._evictions_seen)
        self._evictions_seen = now.evictions
        stats.prefix_cache_bytes, stats.prefix_cache_blocks = now.bytes, now.blocks
        stats.prefix_store_s += self._store_s
        self._store_s = 0.0

    def set_prefix_cache(self, cache: PrefixCache | None, stats: DecoderStats) -> None:
        """Use this prefix cache (None: none) from the next admission on (step thread)."""
        self.prefix_cache = cache
        self._evictions_seen = cache.stats().evictions if cache is not None else 0
        stats.prefix_cache_bytes = stats.prefix_cache_blocks = 0
        self._prefix_stats(stats)

    def _store_prefix(
        self, req: GenerationRequest, kv_t: BatchKV, row_t: int, kv_d: BatchKV, row_d: int
    ) -> None:
        """Store the full blocks of the request's prompt[:-1] from the rows that hold it
        (their first valid slots) in the prefix cache; the target's alone where the
        draft holds only a window of the prompt."""
        cache = self.prefix_cache
        n = len(req.prompt_ids) - 1
        if cache is None or n < cache.block_tokens:
            return
        t0 = time.perf_counter()
        cache.store(
            req.prompt_ids[:n],
            lambda start, end: (
                kv_t.row_slots(row_t, start, end),
                None if self.draft_context else kv_d.row_slots(row_d, start, end),
            ),
        )
        self._store_s += time.perf_counter() - t0

    def _prefill_within_budget(self, stats: DecoderStats) -> None:
        """Prefill at most prefill_chunk prompt tokens this step, in arrival order: prompts
        that fit whole are prefilled together; a longer one gets a chunk now and more in
        the next steps, so one long prompt never stalls the rows that are decoding."""
        budget = self.prefill_chunk
        whole: list[GenerationRequest] = []
        rests: list[PrefillJob] = []  # cached prefixes whose rest fits now
        while self._prefilling:
            job = self._prefilling[0]
            if job.done == job.cached and job.remaining <= budget:
                self._prefilling.popleft()
                if job.cached:
                    rests.append(job)
                else:
                    whole.append(job.req)
                budget -= job.remaining
                continue
            if budget <= 0:
                break
            n = min(job.remaining, budget)
            self._prefill_chunk(job, n, stats)
            budget -= n
            if job.remaining == 0:
                self._prefilling.popleft()
                self._complete(job)
        ride = self.fuse_prefill and bool(self.rows)  # a verification follows this step
        if not ride:
            self._prefill_rests(rests, stats)
            for job in rests:
                self._complete(job)
        for i in range(0, len(whole), self._prefill_batch):
            self._prefill(whole[i : i + self._prefill_batch], stats, ride)
        if ride:
            for job in rests:
                self._ride_rest(job, stats)

    def _prefill_rests(self, jobs: list[PrefillJob], stats: DecoderStats) -> None:
        """Cached prefixes' rests with no verification to ride on: the target's in one
        forward (a group per job, against its cached slots) where the target runs grouped
        forwards, the draft's one job at a time."""
        jobs = [j for j in jobs if j.remaining]
        if len(jobs) < 2 or not self.fuse_prefill:
            for job in jobs:
                self._prefill_chunk(job, job.remaining, stats)
            return
        t0 = time.perf_counter()
        groups = []
        for job in jobs:
            assert job.kv_t is not None and job.kv_d is not None
            rest = right_aligned([list(job.req.prompt_ids[job.done : -1])], [job.done])
            ids, pos, real = (t.to(self.device) for t in rest)
            groups.append(Group(job.kv_t, ids, pos, real))
            self._draft_prefill(job, len(job.req.prompt_ids) - 1)
        forward_groups(self._target_base, groups)
        elapsed = time.perf_counter() - t0
        stats.prefill_time_s += elapsed
        for job in jobs:
            job.done += job.remaining
            job.seconds += elapsed / len(jobs)

    def _complete(self, job: PrefillJob) -> None:
        """A job whose caches hold all of prompt[:-1] joins the batch."""
        assert job.kv_t is not None and job.kv_d is not None
        self._draft_prefill(job, len(job.req.prompt_ids) - 1)  # a whole hit's window
        self._store_prefix(job.req, job.kv_t, 0, job.kv_d, 0)
        self.target_kv.append_rows(job.kv_t)
        self.draft_kv.append_rows(job.kv_d)
        self._join(job.req, job.seconds, job.cached)

    def _ride_rest(self, job: PrefillJob, stats: DecoderStats) -> None:
        """A cached prefix's rest: the draft's prefill now, the target's (with the last
        prompt token) rides on this step's verification, against the cached slots."""
        assert job.kv_t is not None and job.kv_d is not None
        t0 = time.perf_counter()
        prompt = list(job.req.prompt_ids)
        self._draft_prefill(job, len(prompt) - 1)
        rest = right_aligned([prompt[job.done :]], [job.done])
        self._riding_base.append(job.kv_t.length)
        self.riding.append(Group(job.kv_t, *(t.to(self.device) for t in rest)))
        self.draft_kv.append_rows(job.kv_d)
        stats.fused_prefills += 1
        elapsed = time.perf_counter() - t0
        stats.prefill_time_s += elapsed
        self._join(job.req, job.seconds + elapsed, job.cached)

    def _prefill_chunk(self, job: PrefillJob, n: int, stats: DecoderStats) -> None:
        """The next n tokens of one prompt into its own caches (they join when complete)."""
        t0 = time.perf_counter()
        if job.kv_t is None or job.kv_d is None:
            job.kv_t, job.kv_d = BatchKV(self.device), BatchKV(self.device)
        ids = torch.tensor([job.req.prompt_ids[job.done : job.done + n]], device=self.device)
        pos = torch.arange(job.done, job.done + n, device=self.device).unsqueeze(0)
        real = torch.ones(1, n, dtype=torch.bool, device=self.device)
        fill_caches(self._target_base, job.kv_t, ids, pos, real)
        self._draft_prefill(job, job.done + n)
        job.done += n
        elapsed = time.perf_counter() - t0
        job.seconds += elapsed
        stats.prefill_time_s += elapsed

    def _draft_prefill(self, job: PrefillJob, end: int) -> None:
        """The draft's part of prompt[:end] that job.kv_d lacks: from where it left off,
        or from its window's start (after a hit that brought the target's slots only)."""
        assert job.kv_d is not None
        prompt = job.req.prompt_ids
        start = max(job.draft_done, window_start(len(prompt), self.draft_context))
        if end > start:
            ids, pos, real = right_aligned([list(prompt[start:end])], [start])
            fill_caches(
                self._draft_base,
                job.kv_d,
                ids.to(self.device),
                pos.to(self.device),
                real.to(self.device),
            )
        job.draft_done = max(job.draft_done, end)

    def _prefill(
        self, reqs: list[GenerationRequest], stats: DecoderStats, ride: bool = False
    ) -> None:
        """Prefill prompt[:-1] of several requests in one forward per model, then join the
        batch (a one-token prompt gets a single hole slot). ride: rows are decoding, so
        only the draft's prefill runs now; the target's rides on this step's verification
        forward, each whole prompt followed by the drafts this step makes for it."""
        t0 = time.perf_counter()
        prompts = [list(r.prompt_ids) for r in reqs]
        ids, pos, real = (
            t.to(self.device) for t in right_aligned([p[:-1] for p in prompts], [0] * len(prompts))
        )
        kv_d = BatchKV(self.device)
        starts = [window_start(len(p), self.draft_context) for p in prompts]
        window = right_aligned([p[s:-1] for p, s in zip(prompts, starts, strict=True)], starts)
        fill_caches(self._draft_base, kv_d, *(t.to(self.device) for t in window))
        if ride:
            whole = right_aligned(prompts, [0] * len(prompts))
            self._riding_base.append(0)
            self.riding.append(Group(BatchKV(self.device), *(t.to(self.device) for t in whole)))
            stats.fused_prefills += len(reqs)
        else:
            kv_t = BatchKV(self.device)
            fill_caches(self._target_base, kv_t, ids, pos, real)
            for i, req in enumerate(reqs):
                self._store_prefix(req, kv_t, i, kv_d, i)
            self.target_kv.append_rows(kv_t)
        self.draft_kv.append_rows(kv_d)
        elapsed = time.perf_counter() - t0
        stats.prefill_time_s += elapsed
        for req in reqs:
            self._join(req, elapsed)

    @property
    def n_riding(self) -> int:
        """Rows at the end of the batch whose target cache is not in target_kv yet."""
        return sum(g.ids.shape[0] for g in self.riding)

    def riding_groups(self, drafts: torch.Tensor | None = None) -> list[Group]:
        """The riding rows' target groups: each whole prompt, right-aligned, then (given
        drafts (n_riding, k)) the row's drafts at the positions after it."""
        if drafts is None or drafts.shape[1] == 0:
            return list(self.riding)
        out, start = [], 0
        k = drafts.shape[1]
        steps = torch.arange(1, k + 1, device=self.device).unsqueeze(0)
        for g in self.riding:
            n = g.ids.shape[0]
            out.append(
                Group(
                    g.kv,
                    torch.cat([g.ids, drafts[start : start + n]], dim=1),
                    torch.cat([g.pos, g.pos[:, -1:] + steps], dim=1),
                    torch.cat([g.real, torch.ones(n, k, dtype=torch.bool, device=self.device)], 1),
                )
            )
            start += n
        return out

    def land_riding(self, accepted: torch.Tensor) -> None:
        """After the verification that carried them: each riding row's target cache keeps
        its prompt and accepted drafts (accepted (n_riding,)), and joins target_kv; the
        prompts' blocks go to the prefix cache."""
        start = 0
        first = len(self.rows) - self.n_riding  # the riding rows are the batch's last
        for g, base in zip(self.riding, self._riding_base, strict=True):
            n, width = g.ids.shape
            g.kv.invalidate_tail(base + width, accepted[start : start + n])
            for j in range(n):
                row = first + start + j
                self._store_prefix(self.rows[row].req, g.kv, j, self.draft_kv, row)
            self.target_kv.append_rows(g.kv)
            start += n
        self.riding, self._riding_base = [], []

    def drop_riding(self) -> None:
        """After a failed step: riding rows whose target cache may be half written leave
        the batch (the step's exception reaches their callers)."""
        n = self.n_riding
        self.riding, self._riding_base = [], []
        if n:
            keep = list(range(len(self.rows) - n))
            self.rows = self.rows[: len(keep)]
            self.draft_kv.select_rows(keep)

    def _join(self, req: GenerationRequest, prefill_s: float, cached: int = 0) -> None:
        """A prefilled request becomes a row (its caches were appended in the same order)."""
        p = list(req.prompt_ids)
        seed = None
        if not req.sampling.greedy:
            seed = req.sampling.seed
            if seed is None:
                seed = int.from_bytes(os.urandom(8), "little")
        row = Row(req, p, len(p), len(p) - 1, seed=seed, est=self.acceptance_prior())
        if req.logprobs is not None:
            row.logprobs = []
        row.stats.prefill_time_s = prefill_s
        row.stats.cached_prompt_tokens = cached
        self.rows.append(row)

    def draft_backlog(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, real) on the device: the tokens each row's draft cache has not
        seen yet, seq[draft_seen:], right-aligned."""
        pending = [r.seq[r.draft_seen :] for r in self.rows]
        starts = [r.draft_seen for r in self.rows]
        ids, pos, real = right_aligned(pending, starts)
        return ids.to(self.device), pos.to(self.device), real.to(self.device)

    def sampling(self) -> BatchSampling:
        """How the rows choose tokens this step: their parameters, seeds and positions."""
        return BatchSampling.for_rows(
            [r.req.sampling for r in self.rows],
            [r.seed for r in self.rows],
            [len(r.seq) for r in self.rows],
            self.device,
        )

    def last_positions(self) -> torch.Tensor:
        """(B,) the position of each row's last token (the next verification's first input)."""
        return torch.tensor([len(r.seq) - 1 for r in self.rows], device=self.device)

    def fit_context(self, k: int) -> int:
        """Shrink k so no row passes the target's positions (k = 0 stays 0)."""
        if self.max_positions and k > 0:
            room = min(self.max_positions - len(r.seq) for r in self.rows)
            k = max(1, min(k, room - 1))
        return k

    def count_idle(self, k: int) -> None:
        for r in self.rows:
            r.idle_steps = r.idle_steps + 1 if k == 0 else 0

    def advance(
        self,
        outcomes: Sequence[RowOutcome],
        k: int,
        draft_s: float,
        target_s: float,
        stats: DecoderStats,
        from_lookup: Sequence[bool] = (),
        draft_ran: bool = True,
    ) -> list[StepOutput]:
        """Append each row's emitted tokens, record the step, retire finished rows.
        from_lookup[i]: row i's k drafts came from lookup.py, not the draft model (their
        acceptance is counted apart and says nothing of the draft's); draft_ran: the
        draft model ran its k forwards."""
        outputs: list[StepOutput] = []
        keep: list[int] = []
        for i, (r, o) in enumerate(zip(self.rows, outcomes, strict=True)):
            if i < len(from_lookup) and from_lookup[i]:
                stats.record_lookup(k, o.accepted)
                r.stats.lookup_drafted += k
                r.stats.lookup_accepted += o.accepted
            else:
                if k > 0:
                    r.est.update(o.accepted, k)
                credited = o.accepted + int(o.sibling_hit)
                stats.sibling_hits += int(o.sibling_hit)
                record_request_verification(r.stats, k, credited)
                stats.record_verification(k, credited)
            r.stats.draft_time_s += draft_s
            r.stats.target_time_s += target_s
            new_tokens, reason = self._append(r, o.emitted)
            stats.generated_tokens += len(new_tokens)
            lps = None
            if r.logprobs is not None and o.logprobs is not None:
                lps = o.logprobs[: len(new_tokens)]  # what a stop or the length cut kept
                r.logprobs.extend(lps)
            outputs.append(
                StepOutput(
                    r.req.request_id,
                    new_tokens,
                    reason is not None,
                    reason,
                    lps,
                    r.stats.cached_prompt_tokens,
                )
            )
            if reason is None:
                keep.append(i)
            else:
                self._finish(r, reason, stats)
        stats.batch_steps += 1
        stats.draft_time_s += draft_s
        stats.target_time_s += target_s
        stats.draft_forwards += k if draft_ran else 0
        stats.target_forwards += 1
        if len(keep) != len(self.rows):
            self._keep(keep)
        self.target_kv.maybe_compact()
        self.draft_kv.maybe_compact()
        return outputs

    def _append(self, r: Row, emitted: list[int]) -> tuple[list[int], str | None]:
        out: list[int] = []
        for t in emitted:
            r.seq.append(t)
            out.append(t)
            if t in r.req.stop_token_ids:
                return out, "stop"
            if len(r.seq) - r.n_prompt >= r.req.max_new_tokens:
                return out, "length"
        if self.max_positions and len(r.seq) >= self.max_positions:
            return out, "length"
        return out, None

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.target_kv.select_rows(keep)
        self.draft_kv.select_rows(keep)

    def _finish(self, r: Row, reason: str, stats: DecoderStats) -> None:
        stats.requests_finished += 1
        self.results[r.req.request_id] = GenerationResult(
            r.req.request_id, list(r.req.prompt_ids), list(r.output), reason, r.stats, r.logprobs
        )
