"""SpeculativeDecoder: exact speculative decoding with a compressed draft head, batched
and step-wise.

Per step, for all active rows at once (`_speculate`):
  1. draft k tokens with the (compressed) draft head, one draft forward each (drafting.py);
  2. verify them with one target forward over k+1 tokens (verification.py);
  3. keep the accepted prefix plus one target token (sampling.py decides);
  4. roll back rejected cache slots by marking them holes (kv.py).

Greedy output equals the target's own greedy decoding; sampled output follows the
target's warped distribution exactly (q = what the draft sampled from, over the full
vocabulary, zero outside the head's subset). Exactness is tested in fp32.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slimspec.cpu import target_form
from slimspec.cpu.draft_quantization import AUTO, HEAD_BITS, quantize_draft, resolve_auto
from slimspec.cpu.target_packing import maybe_pack_target
from slimspec.decoding import grouped_forward
from slimspec.decoding.adaptive import PROBE_EVERY, AcceptanceEstimate, CostModel, choose_batch_k
from slimspec.decoding.compression import CompressedHead, resolve_rerank
from slimspec.decoding.draft_context import resolve_draft_context
from slimspec.decoding.drafting import (
    Drafter,
    HeadDrafter,
    HeadInUse,
    Proposal,
    lookup_proposal,
    swap_in_lookup,
)
from slimspec.decoding.engine import DraftHeadInfo, Engine, eos_token_ids
from slimspec.decoding.grammar import GrammarRows
from slimspec.decoding.kv import decoder_stack
from slimspec.decoding.lookup import LookupDrafts, LookupPlan, resolve_lookup_tokens
from slimspec.decoding.prefix_cache import BLOCK_TOKENS, PrefixCache, mb_to_bytes, resolve_mb
from slimspec.decoding.quality import ShadowCheck
from slimspec.decoding.ratio_monitor import RatioReport
from slimspec.decoding.rows import RowBatch
from slimspec.decoding.sampling import BatchSampling
from slimspec.decoding.settings import DecoderSettings, StepSettings
from slimspec.decoding.siblings import resolve_sibling_drafts
from slimspec.decoding.stats import DecoderStats
from slimspec.decoding.types import GenerationRequest, GenerationResult, SamplingParams, StepOutput
from slimspec.decoding.verification import TargetVerifier
from slimspec.draft_head.artifact import (
    CalibrationArtifact,
    artifact_time,
    draft_head_for,
    find_artifact,
    resolve_artifact,
    special_token_ids,
)
from slimspec.draft_head.head import DraftHead, HeadConfig, check_ratio, check_vocab_size
from slimspec.draft_head.traffic import RankingStatus, TrafficRanking
from slimspec.draft_head.traffic_store import resolve_counts_path
from slimspec.weights.loading import (
    check_draft_vocabulary,
    check_same_vocabulary,
    load_causal_lm,
    resolve_device,
    resolve_model_path,
    torch_dtype,
)
from slimspec.weights.registry import DEFAULT_DRAFT, DEFAULT_TARGET

log = logging.getLogger(__name__)

WARMUP = "__warmup__"  # request-id prefix of the warm-up generations (not traffic)


def log_draft_head(calibrated: bool, source: str | None) -> None:
    """Say at load which draft head this engine serves (the operator's calibration
    reaching the pod, or not, is visible here and in slimspec_draft_head_info)."""
    if calibrated:
        log.info("draft head: calibrated, artifact %s", source or "(in memory)")
    else:
        log.info("draft head: uncalibrated fallback (no calibration artifact)")


class SpeculativeDecoder(Engine):
    """Exact speculative decoding with a compressed draft head.

    SpeculativeDecoder(small_model_path=..., compression_ratio=0.3, vocab_size=100000)
    loads the draft from small_model_path and the target from MODEL_PATH (or the
    registry default); from_pretrained and from_models name both. vocab_size caps how
    many tokens the draft head scores.
    """

    def __init__(
        self,
        small_model_path: str | None = None,
        compression_ratio: float = 0.3,
        vocab_size: int | None = None,
        *,
        target_model_path: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        **options: Any,
    ) -> None:
        check_ratio(compression_ratio)
        check_vocab_size(vocab_size)
        dt = torch_dtype(dtype or os.environ.get("SLIMSPEC_DTYPE", "bfloat16"))
        dev = resolve_device(device or os.environ.get("SLIMSPEC_DEVICE", "auto"))
        target_path = target_model_path or os.environ.get("MODEL_PATH") or DEFAULT_TARGET
        draft_path = small_model_path or os.environ.get("DRAFT_MODEL_PATH") or DEFAULT_DRAFT
        target, tok = load_causal_lm(target_path, dtype=dt, device=dev)
        draft, dtok = load_causal_lm(draft_path, dtype=dt, device=dev)
        check_same_vocabulary(tok, dtok)
        calibration = options.pop("calibration", None)
        if calibration is None:
            # SLIMSPEC_CALIBRATION: an artifact made for this model pair elsewhere (the
            # operator's calibration Job); named explicitly, so a missing one is an error.
            calibration = os.environ.get("SLIMSPEC_CALIBRATION") or find_artifact(
                resolve_model_path(draft_path)
            )
        self._setup(
            target,
            draft,
            tok,
            compression_ratio=compression_ratio,
            vocab_size=vocab_size,
            calibration=calibration,
            target_dir=resolve_model_path(target_path, fetch=False),
            names=(str(target_path), str(draft_path)),
            loaded_by_name=True,
            **options,
        )

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls,
        target: str | None = None,
        draft: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        compression_ratio: float = 0.3,
        num_draft_tokens: int | None = None,
        **options: Any,
    ) -> SpeculativeDecoder:
        return cls(
            small_model_path=draft,
            compression_ratio=compression_ratio,
            target_model_path=target,
            dtype=dtype,
            device=device,
            num_draft_tokens=num_draft_tokens,
            **options,
        )

    @classmethod
    def from_models(
        cls,
        target_model: Any,
        draft_model: Any,
        tokenizer: Any = None,
        *,
        compression_ratio: float = 0.3,
        num_draft_tokens: int | None = None,
        **options: Any,
    ) -> SpeculativeDecoder:
        self = cls.__new__(cls)
        self._setup(
            target_model,
            draft_model,
            tokenizer,
            compression_ratio=compression_ratio,
            num_draft_tokens=num_draft_tokens,
            **options,
        )
        return self

    def _setup(
        self,
        target: Any,
        draft: Any,
        tokenizer: Any,
        *,
        compression_ratio: float = 0.3,
        vocab_size: int | None = None,
        num_draft_tokens: int | None = None,
        max_draft_tokens: int = 8,
        quality_threshold: float = 0.95,
        fallback_strategy: str = "auto",
        calibration: str | Path | CalibrationArtifact | None = None,
        draft_quantization: str | None = AUTO,
        pack_target: bool | None = None,
        target_quantization: str | None = None,
        target_dir: Path | None = None,
        sibling_drafts: int | None = None,
        lookup_tokens: int | None = None,
        draft_context: int | None = None,
        shadow_every: int = 8,
        prefill_batch: int = 8,
        prefill_chunk: int = 512,
        fuse_prefill: bool | None = None,
        prefix_cache_mb: float | None = None,
        prefix_block_tokens: int = BLOCK_TOKENS,
        adaptive_skip: bool = True,
        shadow_min_samples: int = 64,
        shadow_window: int = 256,
        rerank_from_traffic: bool | None = None,
        traffic_counts: str | Path | None = None,
        names: tuple[str, str] = ("target", "draft"),
        loaded_by_name: bool = False,
    ) -> None:
        self._settings = DecoderSettings(
            compression_ratio,
            quality_threshold,
            fallback_strategy,
            num_draft_tokens,
            max_draft_tokens,
        )
        vocab_cap = check_vocab_size(vocab_size)
        siblings = resolve_sibling_drafts(sibling_drafts)
        self.target, self.draft = target.eval(), draft.eval()
        self.tokenizer, self.names = tokenizer, names
        self.device = self.target.get_output_embeddings().weight.device
        draft_vocab = check_draft_vocabulary(self.target, self.draft, tokenizer)
        self.calibration = resolve_artifact(calibration, draft_vocab)
        self.calibration_source = str(calibration) if isinstance(calibration, str | Path) else None
        log_draft_head(self.calibration is not None, self.calibration_source)
        head = draft_head_for(self.draft.get_output_embeddings(), self.calibration, tokenizer)
        if draft_quantization == AUTO:
            draft_quantization = resolve_auto(self.draft, self.device)
        self.draft_quantization = draft_quantization
        # The target's weights in their own form where it can be (cpu/target_form.py);
        # dense ones get multi-token verification at one-token cost on CPU
        # (cpu/target_packing.py).
        self.target_form = target_form.apply(self.target, target_quantization, target_dir)
        log.info("target weights: %s", self.target_form.describe())
        self.target_packed = self.target_form.quantization == target_form.NONE and (
            maybe_pack_target(self.target, pack_target)
        )
        # New prompts' target prefill rides on the verification forward (after packing:
        # it wraps the attention packing chose; not with sibling drafts, whose tree
        # attention is the batch's).
        self.fused_prefill = siblings == 0 and grouped_forward.enable_where_wanted(
            self.target, fuse_prefill
        )
        if draft_quantization is not None:
            self.draft = quantize_draft(self.draft, draft_quantization)
            if draft_quantization in HEAD_BITS:  # the subset head's rows too, where native
                head.use_low_bit(HEAD_BITS[draft_quantization])
        self.adaptive_skip = adaptive_skip
        self.stats = DecoderStats()
        self._cost = CostModel()
        self._verifier = TargetVerifier(self.target, self._clock)
        self._grammar = GrammarRows(tokenizer, self._verifier.vocab)  # structured output
        self._heads = HeadInUse(head, self.calibration, vocab_cap)
        self._sibling_drafts = siblings
        # Drafts copied from the row's own earlier text where that beats a draft step.
        self._lookup = LookupDrafts(resolve_lookup_tokens(lookup_tokens))
        log.info("lookup drafts: %s", self._lookup.max_tokens or "off")
        # The draft prefills only the last tokens of a prompt (draft_context.py).
        window = resolve_draft_context(draft_context)
        log.info("draft's prompt window: %s", f"{window} tokens" if window else "whole prompts")
        # Held as the two-method interface: the step only proposes and keeps.
        self._drafter: Drafter = HeadDrafter(self.draft, self._heads, siblings, self._clock)
        # The head follows the traffic; counts persist for a draft loaded by name.
        counts = resolve_counts_path(
            traffic_counts, names[1] if loaded_by_name else None, head.vocab
        )
        traffic = TrafficRanking(
            head,
            special_token_ids(tokenizer),
            counts,
            artifact_time(calibration),
            resolve_rerank(rerank_from_traffic),
        )
        self._shadow = ShadowCheck(shadow_every, shadow_min_samples, shadow_window)
        self._compressed = CompressedHead(
            self._heads,
            self._settings,
            self._cost,
            self._shadow,
            traffic,
            self.calibration,
            k_min=0 if adaptive_skip else 1,
        )
        max_positions = getattr(
            self.target.config.get_text_config(), "max_position_embeddings", None
        )
        self._batch = RowBatch(
            self._verifier.base,
            decoder_stack(self.draft),
            self.device,
            max_positions,
            prefill_batch,
            prefill_chunk,
            self.fused_prefill,
            draft_context=window,
        )
        # joining rows start from the acceptance the decoder measured, not a fixed prior
        monitor = self._compressed.monitor
        self._batch.acceptance_prior = lambda: AcceptanceEstimate.seeded(monitor.acceptance.alpha)

        self._step_lock = threading.Lock()
        # When the last step ended with rows still decoding: the time until the next
        # step (the server's delivery, metrics, admission) is part of a served step.
        self._step_end: float | None = None
        self._prefix_block_tokens = prefix_block_tokens
        self.set_prefix_cache_mb(resolve_mb(prefix_cache_mb, os.environ))

    # ----------------------------------------------------------------- settings
    @property
    def compression_ratio(self) -> float:
        """The ratio in force (may be below the requested one after a quality fallback)."""
        return self._settings.ratio

    @property
    def requested_compression_ratio(self) -> float:
        return self._settings.requested_ratio

    def set_compression_ratio(self, ratio: float) -> None:
        """Request a ratio from the next draft step on (re-sending the requested ratio is
        a no-op, so it does not undo a quality fallback)."""
        if self._settings.request_ratio(ratio):
            self._shadow.monitor.reset()

    def set_fused_prefill(self, on: bool) -> bool:
        """Turn riding prefill (docs/engine.md) on or off from the next step, where the
        target supports it; returns whether it is on (benchmarks A/B it in one process)."""
        with self._step_lock:
            self._batch.fuse_prefill = on and self.fused_prefill
            return self._batch.fuse_prefill

    def set_prefix_cache_mb(self, mb: float) -> None:
        """Size the prefix cache (MiB; 0 turns it off) from the next admission on; a new
        cache starts empty (benchmarks A/B it in one process)."""
        size = mb_to_bytes(mb)
        cache = PrefixCache(size, self._prefix_block_tokens) if size else None
        with self._step_lock:
            self._batch.set_prefix_cache(cache, self.stats)
            self._paused_cache: PrefixCache | None = None
        log.info("prefix cache: %s", f"{mb:g} MiB" if cache else "off")

    def set_prefix_cache_on(self, on: bool) -> bool:
        """Stop using the prefix cache, or use it again, keeping what it holds (benchmarks
        A/B it in one process); returns whether one is in use."""
        with self._step_lock:
            if on and self._batch.prefix_cache is None and self._paused_cache is not None:
                self._batch.set_prefix_cache(self._paused_cache, self.stats)
                self._paused_cache = None
            elif not on and self._batch.prefix_cache is not None:
                self._paused_cache = self._batch.prefix_cache
                self._batch.set_prefix_cache(None, self.stats)
            return self._batch.prefix_cache is not None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache in use (None: off)."""
        return self._batch.prefix_cache

    @property
    def quality_threshold(self) -> float:
        return self._settings.threshold

    def set_quality_threshold(self, threshold: float) -> None:
        self._settings.set_threshold(threshold)

    @property
    def fallback_strategy(self) -> str:
        return self._settings.strategy

    def set_fallback_strategy(self, strategy: str) -> None:
        self._settings.set_strategy(strategy)

    @property
    def num_draft_tokens(self) -> int | None:
        return self._settings.fixed_k

    def set_num_draft_tokens(self, k: int | None) -> None:
        self._settings.set_num_draft_tokens(k)

    @property
    def max_draft_tokens(self) -> int:
        return self._settings.max_draft_tokens

    @property
    def sibling_drafts(self) -> int:
        return self._sibling_drafts

    @property
    def draft_context(self) -> int:
        """The most prompt tokens the draft prefills (0: whole prompts)."""
        return self._batch.draft_context

    @property
    def lookup_tokens(self) -> int:
        """The most tokens a lookup draft proposes (0: lookup drafts off)."""
        return self._lookup.max_tokens

    def set_lookup_tokens(self, n: int) -> None:
        """Lookup drafts of at most n tokens from the next step on (0: off); benchmarks
        A/B them in one process."""
        n = resolve_lookup_tokens(n)
        with self._step_lock:
            self._lookup.max_tokens = n

    @property
    def target_vocab(self) -> int:
        return self._verifier.vocab

    @property
    def max_context(self) -> int | None:
        """Most tokens (prompt + generated) a request may hold: the target's positions."""
        return self._batch.max_positions

    @property
    def head(self) -> DraftHead:
        """The compressed head in use (a re-rank from traffic replaces it between steps)."""
        return self._heads.head

    @property
    def ratio_report(self) -> RatioReport | None:
        """The latest prediction of what each ratio costs and buys (ratio_monitor.py)."""
        return self._compressed.report

    def ranking_status(self) -> RankingStatus:
        """Where the head's token ranking comes from, its age and coverage."""
        return self._compressed.ranking_status()

    def draft_head_info(self) -> DraftHeadInfo:
        return DraftHeadInfo(self.calibration is not None, self.calibration_source or "")

    def stop_token_ids(self) -> frozenset[int]:
        """What the server stops requests at: the tokenizer's and the target's EOS ids."""
        return eos_token_ids(self.tokenizer, self.target)

    def rerank_now(self, timeout: float = 60.0, freeze: bool = False) -> bool:
        """Re-rank the head on all the traffic counted so far, wait for it and swap it in
        (benchmarks; re-ranking must be on); freeze: no re-ranking after it. True when a
        re-ranked head is in use on return."""
        traffic = self._compressed.traffic
        traffic.wait(timeout)  # one already running first
        with self._step_lock:
            started = traffic.maybe_start(self.head, self.head_config().subset_size, now=True)
        if started:
            traffic.wait(timeout)
        with self._step_lock:
            before = self.head
            self._compressed.before_step()
            swapped = self.head is not before
            if freeze:
                traffic.enabled = False
        return swapped

    def head_config(self, ratio: float | None = None) -> HeadConfig:
        """The concrete head used at a ratio (the ratio in force by default)."""
        r = self._settings.ratio if ratio is None else check_ratio(ratio)
        return self._heads.config(r)

    # ----------------------------------------------------------------- request API
    def add_request(self, req: GenerationRequest) -> None:
        self._grammar.check(req.grammar)
        self._batch.add(req, self._verifier.vocab)

    def check_grammar(self, grammar: str) -> None:
        self._grammar.check(grammar)

    def cancel(self, request_id: str) -> None:
        self._batch.cancel(request_id)

    def has_work(self) -> bool:
        return self._batch.has_work()

    @property
    def active_requests(self) -> int:
        return len(self._batch.rows)

    def pop_result(self, request_id: str) -> GenerationResult | None:
        """The full result (with stats) of a finished request, once."""
        return self._batch.results.pop(request_id, None)

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop_token_ids: frozenset[int] | set[int] | list[int] | None = None,
        request_id: str = "generate",
    ) -> GenerationResult:
        ids = self.encode(prompt)
        stops = self._default_stops() if stop_token_ids is None else frozenset(stop_token_ids)
        req = GenerationRequest(
            request_id, ids, max_new_tokens, sampling or SamplingParams(), stops
        )
        return self.generate_batch([req])[0]

    def generate_batch(self, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """Decode these requests together until all finish (not while step() runs elsewhere)."""
        if self.has_work():
            raise RuntimeError(
                "generate/generate_batch need an idle decoder (requests are running via step())"
            )
        for r in reqs:
            self.add_request(r)
        while self.has_work():
            self.step()
        return [self._batch.results.pop(r.request_id) for r in reqs]

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this decoder has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this decoder has no tokenizer")
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _default_stops(self) -> frozenset[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        return frozenset([eos]) if isinstance(eos, int) else frozenset()

    def warmup(self, tokens: int = 8) -> None:
        """Run a short generation so first requests do not pay one-off costs."""
        if self.has_work():
            return
        prompt = [int(t) for t in self.head.ranking[:4].tolist()]
        greedy = GenerationRequest(f"{WARMUP}1", prompt, tokens, SamplingParams(), frozenset())
        sampled = SamplingParams(temperature=1.0, seed=0)
        # Warm-up always drafts (adaptive k may choose plain target steps on a pair
        # that agrees little), so the draft path runs once and its timings are measured.
        adaptive = self._settings.fixed_k is None
        if adaptive:
            self._settings.set_num_draft_tokens(min(2, self._settings.max_draft_tokens))
        lookup, self._lookup.max_tokens = self._lookup.max_tokens, 0  # (same reason)
        try:
            self.generate_batch([greedy])
            self.generate_batch([GenerationRequest(f"{WARMUP}2", prompt, 4, sampled, frozenset())])
        finally:
            self._lookup.max_tokens = lookup
            if adaptive:
                self._settings.set_num_draft_tokens(None)
        self.stats = DecoderStats()
        with self._step_lock:
            self._compressed.measure_heads(self._clock, self._settings.snapshot())

    # ----------------------------------------------------------------- the step
    def step(self) -> list[StepOutput]:
        with self._step_lock, torch.inference_mode():
            started = self._clock()  # the step's wall time includes admission and prefill
            gap = 0.0 if self._step_end is None else started - self._step_end
            self._compressed.before_step()
            try:
                outputs = self._batch.admit(self.stats)
                self._compressed.count_prompts(
                    [
                        r.prompt_ids
                        for r in self._batch.admitted
                        if not r.request_id.startswith(WARMUP)
                    ]
                )
                if self._batch.rows:
                    outputs.extend(self._speculate(started, gap))
            finally:
                self._batch.drop_riding()  # landed by _speculate unless the step failed
                self._step_end = time.perf_counter() if self._batch.rows else None
            return outputs

    def _speculate(self, started: float, gap: float) -> list[StepOutput]:
        """One draft-verify-accept step for every active row (`started`: the step's start,
        `gap`: the time since the last step while rows were decoding)."""
        batch, s = self._batch, self._settings.snapshot()
        rows, sampling = batch.rows, batch.sampling()
        k = self._choose_k(s)
        shadow = self._shadow.due(k, s.ratio)
        k = batch.fit_context(k)
        # a row that has not drafted for PROBE_EVERY steps drafts now (its estimate of
        # the draft would otherwise go stale while lookup or plain steps run)
        probe = any(r.idle_steps >= PROBE_EVERY for r in rows)
        t_lookup = self._clock()
        plan, lookup = self._lookup_plan(k, shadow or probe)
        batch.count_idle(0 if lookup else k)
        sampling = sampling.with_noise(max(k, lookup) + 1, self._verifier.vocab)
        grammar = self._grammar.step(
            [r.req.request_id for r in rows], [r.req.grammar for r in rows]
        )
        if grammar is not None:
            sampling = replace(sampling, grammar=grammar)
        if lookup and plan is not None:
            seconds = self._clock() - t_lookup
            proposal = lookup_proposal(batch, plan.cut(lookup), sampling, seconds)
            k = proposal.k
        else:
            proposal = self._drafter.propose(batch, k, sampling, s.ratio, shadow)
            if plan is not None and not shadow and not probe and len(rows) > 1:
                proposal = self._swap_in_lookup(plan, proposal, sampling)
        from_lookup = [proposal.from_lookup(i) for i in range(len(rows))]
        # new rows' prompts share the verification forward: their slots are prefill
        riding_tokens = sum(g.tokens for g in batch.riding_groups())
        verdict = self._verifier.verify(batch, proposal, sampling, want_argmax=shadow)
        self._verifier.keep_accepted(batch, proposal, verdict)
        verified = len(rows) * (k + 1 + proposal.siblings.shape[1])
        if lookup:  # the draft cache saw none of it: its backlog feeds the next draft step
            self._cost.observe_verification(verdict.seconds, verified + riding_tokens)
        else:  # the draft cache keeps none of a swapped row's drafts
            draft_kept = verdict.num_accepted
            if proposal.swapped:
                swapped = torch.tensor(proposal.swapped, device=draft_kept.device)
                draft_kept = draft_kept.masked_fill(swapped, 0)
            self._drafter.keep_accepted(batch, proposal, draft_kept)
            self._cost.observe(
                proposal.seconds,
                verdict.seconds,
                k,
                proposal.catch_up_s,
                verified,
                len(rows),
                riding_tokens,
            )
        prefill_s = self._cost.marginal_seconds(riding_tokens, verdict.seconds)
        if shadow:
            self._compressed.shadow_check(proposal, verdict, s, self.stats)
        outcomes = verdict.outcomes(proposal, [r.req.logprobs for r in rows])
        if grammar is not None:
            grammar.finish([o.emitted for o in outcomes])
        n_rows = len(rows)
        target_s = verdict.seconds - prefill_s
        self.stats.prefill_time_s += prefill_s
        if plan is not None:
            verified_lookup = [k if f else 0 for f in from_lookup]
            emitted = [o.emitted for o in outcomes]
            self._lookup.learn(plan, verified_lookup, [o.accepted for o in outcomes], emitted)
        outputs = batch.advance(
            outcomes, k, proposal.seconds, target_s, self.stats, from_lookup, not proposal.lookup
        )
        # the draft's acceptance: rows that verified its drafts
        accepted = [o.accepted for o, f in zip(outcomes, from_lookup, strict=True) if not f]
        served = [o for o in outputs if not o.request_id.startswith(WARMUP)]  # not traffic
        # What the ratio model's draft + verification leave out: prefill, sampling, upkeep,
        # and the server's work between two steps (a gap longer than a step is a pause).
        wall = self._clock() - started
        other_s = wall + min(max(0.0, gap), wall) - proposal.seconds - target_s
        self._compressed.after_step(n_rows, s, proposal, accepted, served, other_s)
        return outputs

    def _lookup_plan(self, k: int, must_draft: bool) -> tuple[LookupPlan | None, int]:
        """Every row's lookup draft, and how many of its tokens this step verifies instead
        of drafting k (0: draft). Not when the step must draft (a shadow check needs the
        draft's tokens; a probe re-measures the draft) nor with constrained rows (their
        drafts follow the grammar's state)."""
        rows = self._batch.rows
        if not self._lookup.max_tokens or any(r.req.grammar for r in rows):
            return None, 0
        plan = self._lookup.plan([r.seq for r in rows], [r.ngrams for r in rows])
        if must_draft:
            return plan, 0
        room = self._batch.fit_context(self._lookup.max_tokens)
        length = self._lookup.choose(
            plan, [r.est.alpha for r in rows], k, self._cost.relative_costs(len(rows)), room
        )
        return plan, length

    def _swap_in_lookup(
        self, plan: LookupPlan, proposal: Proposal, sampling: BatchSampling
    ) -> Proposal:
        """A batch's draft step: the rows whose lookup draft is expected to keep more of
        the k tokens than the draft's verify it instead (greedy and seeded rows: their
        verification compares tokens)."""
        rows = self._batch.rows
        coupled = sampling.coupled or (False,) * len(rows)
        compares = [sampling.all_greedy or c for c in coupled]
        alphas = [r.est.alpha for r in rows]
        swap = self._lookup.swaps(plan, proposal.k, alphas, compares)
        return swap_in_lookup(proposal, plan.drafts, swap) if any(swap) else proposal

    def _choose_k(self, s: StepSettings) -> int:
        """The step's k: fixed, or adaptive (k = 0 is a plain target step, unless
        adaptive_skip is off)."""
        if s.fixed_k is not None:
            return s.fixed_k
        rows = self._batch.rows
        k = choose_batch_k(
            [r.est.alpha for r in rows],
            [r.idle_steps for r in rows],
            self._cost.relative_costs(len(rows)),
            0 if self.adaptive_skip else 1,
            s.max_draft_tokens,
        )
        return k

    def _clock(self) -> float:
        """Seconds, once the device has finished its queued work (phase timing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
