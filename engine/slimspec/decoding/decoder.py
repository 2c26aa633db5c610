"""The speculative loop: a batched, step-wise SpeculativeDecoder.

Per step, for all active rows at once:
  1. draft k tokens with the (compressed) draft head, one draft forward each;
  2. verify them with one target forward over k+1 tokens;
  3. keep the accepted prefix plus one target token (sampling.py decides);
  4. roll back rejected cache slots by marking them holes (kv.py).

Invariants per row: the target cache holds seq[:-1] (the last token is always
the first input of the next verification); the draft cache holds seq[:draft_seen].
Greedy output equals the target's own greedy decoding; sampled output follows the
target's warped distribution exactly (q = what the draft sampled from, over the
full vocabulary, zero outside the head's subset). Exactness tests run in fp32.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slimspec.decoding import sampling as S
from slimspec.decoding.adaptive import (
    AcceptanceEstimate,
    RelativeCosts,
    VerifyCost,
    choose_k,
    draft_forward_seconds,
    one_token_seconds,
    relative_costs,
)
from slimspec.decoding.kv import BatchKV
from slimspec.decoding.quality import (
    REASON_QUALITY,
    QualityMonitor,
    check_strategy,
    check_threshold,
    fallback_decision,
)
from slimspec.decoding.siblings import tree_attention, tree_positions, verify_greedy_siblings
from slimspec.decoding.stats import DecoderStats, record_request_verification
from slimspec.decoding.types import (
    GenerationRequest,
    GenerationResult,
    RequestStats,
    SamplingParams,
    StepOutput,
)
from slimspec.draft_head.artifact import (
    CalibrationArtifact,
    find_artifact,
    load_artifact,
    quick_ranking,
)
from slimspec.draft_head.head import DraftHead, HeadConfig, check_ratio, subset_size_for_ratio

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
PROBE_EVERY = 8
RATIO_LADDER = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or os.environ.get("SLIMSPEC_DTYPE", "bfloat16")
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(
        name, name
    )
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def parse_device(device: str | torch.device | None) -> torch.device:
    name = str(device or os.environ.get("SLIMSPEC_DEVICE", "auto"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def check_vocab_size(vocab_size: int | None) -> int | None:
    """vocab_size = upper bound on how many tokens the draft head scores (None = no bound)."""
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(
            "vocab_size is an upper bound on the draft's scored vocabulary and must be "
            f"a positive int, got {vocab_size!r}"
        )
    return vocab_size


def resolve_path(name_or_path: str) -> str:
    """A local directory as is; a registry name through slimspec.weights.loading (if available)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return str(p)
    try:
        from slimspec.weights.loading import resolve_model_path  # owned by the models engineer

        return str(resolve_model_path(name_or_path))
    except ImportError:
        pass
    raise FileNotFoundError(
        f"model path {name_or_path!r} does not exist "
        "(expected a local Hugging Face model directory)"
    )


def load_model(name_or_path: str, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """(model, tokenizer) from a local directory or a registry name."""
    try:
        from slimspec.weights.loading import load_causal_lm

        return load_causal_lm(name_or_path, dtype=dtype, device=device)
    except ImportError:
        pass
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


def check_tokenizers(target_tok: Any, draft_tok: Any) -> None:
    if target_tok is None or draft_tok is None:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            "target and draft tokenizers differ: speculative decoding needs the same vocabulary"
        )


@dataclass
class _Row:
    req: GenerationRequest
    seq: list[int]
    n_prompt: int
    draft_seen: int
    stats: RequestStats = field(default_factory=RequestStats)
    seed: int | None = None  # sampling rows only; randomness is keyed by (seed, position)
    est: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    idle_steps: int = 0  # consecutive k = 0 steps (adaptive skip)

    @property
    def output(self) -> list[int]:
        return self.seq[self.n_prompt :]


class SpeculativeDecoder:
    """Exact speculative decoding with a compressed draft head.

    Seed form: SpeculativeDecoder(small_model_path=..., compression_ratio=0.3, vocab_size=100000)
    loads the draft from small_model_path and the target from MODEL_PATH (or the
    registry default). vocab_size caps how many tokens the draft head scores.
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
        dt, dev = parse_dtype(dtype), parse_device(device)
        target_path = target_model_path or os.environ.get("MODEL_PATH") or DEFAULT_TARGET
        draft_path = small_model_path or os.environ.get("DRAFT_MODEL_PATH") or DEFAULT_DRAFT
        target, tok = load_model(target_path, dt, dev)
        draft, dtok = load_model(draft_path, dt, dev)
        check_tokenizers(tok, dtok)
        calibration = options.pop("calibration", None)
        if calibration is None:
            try:
                calibration = find_artifact(resolve_path(draft_path))
            except FileNotFoundError:
                calibration = None
        self._setup(
            target,
            draft,
            tok,
            compression_ratio=compression_ratio,
            vocab_size=vocab_size,
            calibration=calibration,
            names=(str(target_path), str(draft_path)),
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
        draft_quantization: str | None = None,
        pack_target: bool | None = None,
        sibling_drafts: int | None = None,
        shadow_every: int = 8,
        prefill_batch: int = 8,
        adaptive_skip: bool = True,
        shadow_min_samples: int = 64,
        shadow_window: int = 256,
        names: tuple[str, str] = ("target", "draft"),
    ) -> None:
        check_ratio(compression_ratio)
        self._vocab_cap = check_vocab_size(vocab_size)
        if num_draft_tokens is not None and (
            not isinstance(num_draft_tokens, int) or num_draft_tokens < 1
        ):
            raise ValueError(
                "num_draft_tokens must be a positive int or None (adaptive), "
                f"got {num_draft_tokens!r}"
            )
        self.target = target.eval()
        self.draft = draft.eval()
        self.tokenizer = tokenizer
        self.names = names
        self.device = self.target.get_output_embeddings().weight.device
        self._target_base = (
            self.target.get_decoder() if hasattr(self.target, "get_decoder") else self.target.model
        )
        self._target_head = self.target.get_output_embeddings()
        self._softcap = getattr(
            self.target.config.get_text_config(), "final_logit_softcapping", None
        )
        self.target_vocab = self._target_head.weight.shape[0]
        draft_head = self.draft.get_output_embeddings()
        draft_vocab = draft_head.weight.shape[0]
        if draft_vocab > self.target_vocab:
            raise ValueError(
                f"draft head scores {draft_vocab} tokens but the target only has "
                f"{self.target_vocab}: vocabularies differ"
            )
        if tokenizer is not None and len(tokenizer) > self.target_vocab:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens, more than the target's {self.target_vocab}"
            )
        art: CalibrationArtifact | None
        art = load_artifact(calibration) if isinstance(calibration, (str, Path)) else calibration
        if art is not None and art.vocab != draft_vocab:
            raise ValueError(
                f"calibration artifact ranks {art.vocab} tokens, the draft head has {draft_vocab}"
            )
        self.calibration = art
        ranking = art.ranking if art is not None else quick_ranking(draft_vocab, tokenizer)
        w = draft_head.weight.detach()
        bias = getattr(draft_head, "bias", None)
        self.head = DraftHead(
            w,
            ranking,
            a=art.a if art is not None else None,
            b=art.b if art is not None else None,
            bias=bias.detach() if bias is not None else None,
        )
        if draft_quantization == "auto":
            from slimspec.cpu.draft_quantization import resolve_auto

            draft_quantization = resolve_auto(self.draft, self.device)
        self.draft_quantization = draft_quantization
        # Multi-token verification at one-token cost on CPU (cpu_pack.py); None = auto.
        self.target_packed = self._maybe_pack_target(pack_target)
        if draft_quantization is not None:
            from slimspec.cpu.draft_quantization import quantize_draft

            self.draft = quantize_draft(self.draft, draft_quantization)
            if draft_quantization in ("int8-fused", "int4-fused"):
                self.head.use_low_bit(8)  # the subset head's rows in int8 too, where native
        self._draft_base = (
            self.draft.get_decoder() if hasattr(self.draft, "get_decoder") else self.draft.model
        )
        self._max_positions = getattr(
            self.target.config.get_text_config(), "max_position_embeddings", None
        )

        self._settings_lock = threading.Lock()
        self._ratio = check_ratio(compression_ratio)
        self._requested_ratio = self._ratio
        self._threshold = check_threshold(quality_threshold)
        self._strategy = check_strategy(fallback_strategy)
        self._fixed_k = num_draft_tokens
        self.sibling_drafts = self._resolve_siblings(sibling_drafts)
        self.max_draft_tokens = max(max_draft_tokens, num_draft_tokens or 1)
        self.shadow_every = shadow_every
        self.prefill_batch = prefill_batch
        self.shadow_min_samples = shadow_min_samples
        self.quality = QualityMonitor(shadow_window)
        self.stats = DecoderStats()
        self._cost_ratio = 0.3  # draft forward / one-token verification of the batch, EMA
        self._verify_cost = VerifyCost()  # verification seconds vs tokens verified
        self.adaptive_skip = adaptive_skip

        self._step_lock = threading.Lock()
        self._queue_lock = threading.Lock()
        self._pending: deque[GenerationRequest] = deque()
        self._cancelled: set[str] = set()
        self._rows: list[_Row] = []
        self._kv_t = BatchKV(self.device)
        self._kv_d = BatchKV(self.device)
        self._results: dict[str, GenerationResult] = {}
        self._step_count = 0

    def _resolve_siblings(self, sibling_drafts: int | None) -> int:
        """How many depths also verify the draft's runner-up (siblings.py); None reads
        SLIMSPEC_SIBLING_DRAFTS, default 0. Off by default: it pays only where verifying a
        few more tokens is nearly free (a GPU); on the 2-core CPU here the extra verify
        cost ate the extra accepted tokens (docs/engine.md)."""
        if sibling_drafts is None:
            sibling_drafts = int(os.environ.get("SLIMSPEC_SIBLING_DRAFTS", "0"))
        if not isinstance(sibling_drafts, int) or sibling_drafts < 0:
            raise ValueError(
                "sibling_drafts must be an int >= 0 or None (SLIMSPEC_SIBLING_DRAFTS, default 0), "
                f"got {sibling_drafts!r}"
            )
        return sibling_drafts

    def _maybe_pack_target(self, pack: bool | None) -> bool:
        from slimspec.cpu import target_packing

        dtype = self._target_head.weight.dtype
        usable = self.device.type == "cpu" and target_packing.packing_available(dtype)
        if pack is None:
            pack = usable and os.environ.get("SLIMSPEC_PACK_TARGET", "1") != "0"
        elif pack and not usable:
            raise ValueError(
                f"pack_target=True needs a bf16/fp16 target on CPU with oneDNN, got "
                f"{dtype} on {self.device}"
            )
        if pack:
            target_packing.pack_target(self.target)
            self._target_head = self.target.get_output_embeddings()
        return bool(pack)

    # ----------------------------------------------------------------- settings
    @property
    def compression_ratio(self) -> float:
        """The ratio in force (may be below the requested one after a quality fallback)."""
        return self._ratio

    @property
    def requested_compression_ratio(self) -> float:
        return self._requested_ratio

    def set_compression_ratio(self, ratio: float) -> None:
        """Request a ratio from the next draft step on.

        Re-sending the ratio already requested is a no-op, so a settings push that
        repeats itself does not undo a quality fallback; a different value resets it.
        """
        r = check_ratio(ratio)
        with self._settings_lock:
            if r == self._requested_ratio:
                return
            self._ratio = self._requested_ratio = r
        self.quality.reset()

    @property
    def quality_threshold(self) -> float:
        return self._threshold

    def set_quality_threshold(self, threshold: float) -> None:
        t = check_threshold(threshold)
        with self._settings_lock:
            self._threshold = t

    @property
    def fallback_strategy(self) -> str:
        return self._strategy

    def set_fallback_strategy(self, strategy: str) -> None:
        s = check_strategy(strategy)
        with self._settings_lock:
            self._strategy = s

    @property
    def num_draft_tokens(self) -> int | None:
        return self._fixed_k

    def set_num_draft_tokens(self, k: int | None) -> None:
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"num_draft_tokens must be a positive int or None, got {k!r}")
        with self._settings_lock:
            self._fixed_k = k
            if k is not None:
                self.max_draft_tokens = max(self.max_draft_tokens, k)

    def head_config(self, ratio: float | None = None) -> HeadConfig:
        """The concrete head used at a ratio (the ratio in force by default)."""
        r = self._ratio if ratio is None else check_ratio(ratio)
        if r == 0.0:
            cfg = HeadConfig(self.head.vocab, None)
        elif self.calibration is not None:
            cfg = self.calibration.config_for(r, self.head.hidden)
        else:
            cfg = HeadConfig(subset_size_for_ratio(r, self.head.vocab), None)
        if self._vocab_cap is not None and cfg.subset_size > self._vocab_cap:
            cfg = HeadConfig(self._vocab_cap, cfg.rank)
        if not self.head.supports(cfg):
            cfg = HeadConfig(min(cfg.subset_size, self.head.vocab), None)
        return cfg

    # ----------------------------------------------------------------- request API
    def add_request(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if req.max_new_tokens < 0:
            raise ValueError(f"request {req.request_id}: max_new_tokens must be >= 0")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.target_vocab]
        if bad:
            raise ValueError(f"request {req.request_id}: token ids out of range: {bad[:5]}")
        with self._queue_lock:
            self._pending.append(req)

    def cancel(self, request_id: str) -> None:
        with self._queue_lock:
            self._cancelled.add(request_id)

    def has_work(self) -> bool:
        with self._queue_lock:
            return bool(self._rows or self._pending)

    @property
    def active_requests(self) -> int:
        return len(self._rows)

    def pop_result(self, request_id: str) -> GenerationResult | None:
        """The full result (with stats) of a finished request, once."""
        return self._results.pop(request_id, None)

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
        return [self._results.pop(r.request_id) for r in reqs]

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this decoder has no tokenizer: pass token ids")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(prompt)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this decoder has no tokenizer")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _default_stops(self) -> frozenset[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        return frozenset([eos]) if isinstance(eos, int) else frozenset()

    def warmup(self, tokens: int = 8) -> None:
        """Run a short generation so first requests do not pay one-off costs."""
        if self.has_work():
            return
        prompt = [int(t) for t in self.head.ranking[:4].tolist()]
        self.generate_batch(
            [GenerationRequest("__warmup__", prompt, tokens, SamplingParams(), frozenset())]
        )
        self.generate_batch(
            [
                GenerationRequest(
                    "__warmup2__", prompt, 4, SamplingParams(temperature=1.0, seed=0), frozenset()
                )
            ]
        )
        self.stats = DecoderStats()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[StepOutput]:
        with self._step_lock, torch.inference_mode():
            outputs = self._admit_and_cancel()
            if self._rows:
                outputs.extend(self._speculate())
            return outputs

    def _admit_and_cancel(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        with self._queue_lock:
            cancelled, self._cancelled = self._cancelled, set()
            new = [r for r in self._pending if r.request_id not in cancelled]
            dropped = [r for r in self._pending if r.request_id in cancelled]
            self._pending.clear()
        for r in dropped:
            outputs.append(StepOutput(r.request_id, [], True, "cancelled"))
            self._store_result(_Row(r, list(r.prompt_ids), len(r.prompt_ids), 0), "cancelled")
        if cancelled:
            keep = [i for i, row in enumerate(self._rows) if row.req.request_id not in cancelled]
            for _i, row in enumerate(self._rows):
                if row.req.request_id in cancelled:
                    outputs.append(StepOutput(row.req.request_id, [], True, "cancelled"))
                    self._store_result(row, "cancelled")
            self._keep_rows(keep)
        todo: list[GenerationRequest] = []
        for req in new:
            if req.max_new_tokens == 0:
                outputs.append(StepOutput(req.request_id, [], True, "length"))
                self._store_result(
                    _Row(req, list(req.prompt_ids), len(req.prompt_ids), 0), "length"
                )
            else:
                todo.append(req)
        # Similar lengths together keep the padding small.
        todo.sort(key=lambda r: len(r.prompt_ids))
        for i in range(0, len(todo), self.prefill_batch):
            self._prefill_group(todo[i : i + self.prefill_batch])
        return outputs

    def _prefill_group(self, reqs: list[GenerationRequest]) -> None:
        """Prefill prompt[:-1] of several requests in one forward per model, then join the batch.

        Prompts are right-aligned; the left padding (and a one-token prompt's single
        slot) are holes, so they cost compute but never influence attention.
        """
        t0 = time.perf_counter()
        prompts = [list(r.prompt_ids) for r in reqs]
        n_max = max(1, max(len(p) - 1 for p in prompts))
        ids = torch.zeros(len(reqs), n_max, dtype=torch.long)
        real = torch.zeros(len(reqs), n_max, dtype=torch.bool)
        pos = torch.zeros(len(reqs), n_max, dtype=torch.long)
        for i, p in enumerate(prompts):
            n = len(p) - 1
            if n > 0:
                ids[i, n_max - n :] = torch.tensor(p[:-1])
                real[i, n_max - n :] = True
                pos[i, n_max - n :] = torch.arange(n)
        inp, pos_d, real_d = ids.to(self.device), pos.to(self.device), real.to(self.device)
        kv_t, kv_d = BatchKV(self.device), BatchKV(self.device)
        self._forward(self._target_base, kv_t, inp, pos_d, real_d)
        self._forward(self._draft_base, kv_d, inp, pos_d, real_d)
        self._kv_t.append_rows(kv_t)
        self._kv_d.append_rows(kv_d)
        elapsed = time.perf_counter() - t0
        self.stats.prefill_time_s += elapsed
        for req, p in zip(reqs, prompts, strict=True):
            seed = None
            if not req.sampling.greedy:
                seed = req.sampling.seed
                if seed is None:
                    seed = int.from_bytes(os.urandom(8), "little")
            row = _Row(req, p, len(p), draft_seen=len(p) - 1, seed=seed)
            row.stats.prefill_time_s = elapsed
            self._rows.append(row)

    def _forward(
        self,
        base: Any,
        kv: BatchKV,
        ids: torch.Tensor,
        pos: torch.Tensor,
        real: torch.Tensor,
        new_allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dtype = base.get_input_embeddings().weight.dtype
        mask = kv.mask_for(real, dtype, new_allowed)
        cache = kv.cache
        if cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=base.config)
        # The cache is updated in place (transformers >= 5 names the argument `cache`).
        out = base(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True
        )
        kv.after_forward(cache, real)
        return out.last_hidden_state

    def _choose_k(self, all_greedy: bool) -> int:
        """Largest per-row choice. k = 0 (a plain target step) only for all-greedy batches:
        sampling rows must draft so their seeded randomness stays schedule-independent.
        A row that chose 0 for PROBE_EVERY steps drafts once to re-measure acceptance."""
        if self._fixed_k is not None:
            return self._fixed_k
        k_min = 0 if (all_greedy and self.adaptive_skip) else 1
        costs = self._relative_costs()
        ks = []
        for r in self._rows:
            k = choose_k(
                r.est.alpha,
                costs.draft,
                k_min,
                self.max_draft_tokens,
                verify_cost_per_token=costs.verify_per_token,
                single_cost=costs.single,
            )
            if k == 0 and r.idle_steps >= PROBE_EVERY:
                # Re-measure acceptance with the k drafting would use, not a lone token.
                k = choose_k(
                    r.est.alpha,
                    costs.draft,
                    1,
                    self.max_draft_tokens,
                    verify_cost_per_token=costs.verify_per_token,
                )
            ks.append(k)
        k = max(ks)
        for r in self._rows:
            r.idle_steps = r.idle_steps + 1 if k == 0 else 0
        return k

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _speculate(self) -> list[StepOutput]:
        rows = self._rows
        b = len(rows)
        dev = self.device
        with self._settings_lock:
            ratio, threshold, strategy = self._ratio, self._threshold, self._strategy
            k = self._choose_k(all(r.req.sampling.greedy for r in rows))
        cfg = self.head_config(ratio)
        subset_ids = self.head.token_ids(cfg)
        self._step_count += 1
        shadow = (
            k > 0
            and ratio > 0
            and self.shadow_every > 0
            and self._step_count % self.shadow_every == 0
        )
        all_greedy = all(r.req.sampling.greedy for r in rows)
        temp, top_k, top_p = S.sampling_tensors([r.req.sampling for r in rows], dev)

        # Context-length guard: shrink k so no row exceeds the target's positions.
        if self._max_positions:
            room = min(self._max_positions - len(r.seq) for r in rows)
            if k > 0:
                k = max(1, min(k, room - 1))

        # Greedy batches also verify the draft's runner-up at the first n_sib depths.
        n_sib = min(k, self.sibling_drafts) if all_greedy and len(subset_ids) > 1 else 0

        # ---- draft phase
        self._sync()
        t0 = time.perf_counter()
        pending = [r.seq[r.draft_seen :] for r in rows]
        p_len = max(len(p) for p in pending)
        ids = torch.zeros(b, p_len, dtype=torch.long)
        pos = torch.zeros(b, p_len, dtype=torch.long)
        real = torch.zeros(b, p_len, dtype=torch.bool)
        for i, (r, toks) in enumerate(zip(rows, pending, strict=False)):
            m = len(toks)
            ids[i, p_len - m :] = torch.tensor(toks)
            pos[i, :] = r.draft_seen
            pos[i, p_len - m :] = torch.arange(r.draft_seen, r.draft_seen + m)
            real[i, p_len - m :] = True
        draft_len_before = self._kv_d.length
        inp, inp_pos, inp_real = ids.to(dev), pos.to(dev), real.to(dev)
        last_pos = torch.tensor([len(r.seq) - 1 for r in rows], device=dev)
        drafts: list[torch.Tensor] = []
        siblings: list[torch.Tensor] = []
        q_subs: list[torch.Tensor] = []
        comp_argmax: list[torch.Tensor] = []
        shadow_hidden: list[torch.Tensor] = []
        first_s = 0.0
        for j in range(k):
            if j == 1:
                self._sync()
                first_s = time.perf_counter() - t0
            hidden = self._forward(self._draft_base, self._kv_d, inp, inp_pos, inp_real)[:, -1]
            logits = self.head.logits(hidden, cfg)
            if j < n_sib:
                top2 = logits.topk(2, dim=-1).indices
                idx = top2[:, 0]
                siblings.append(subset_ids[top2[:, 1]])
            elif all_greedy:
                idx = logits.argmax(dim=-1)
            else:
                q = S.warp_probs(logits, temp, top_k, top_p)
                u = self._uniforms(rows, j, 1, S.STREAM_DRAFT)[:, 0]
                idx = S.sample_from_probs(q, u)
                q_subs.append(q)
            tok = subset_ids[idx]
            drafts.append(tok)
            if shadow:
                comp_argmax.append(subset_ids[logits.argmax(dim=-1)])
                shadow_hidden.append(hidden.clone())  # scored after verification
            inp = tok.unsqueeze(1)
            inp_pos = (last_pos + 1 + j).unsqueeze(1)
            inp_real = torch.ones(b, 1, dtype=torch.bool, device=dev)
        if drafts:
            draft_tokens = torch.stack(drafts, dim=1)  # (B, k)
        else:  # k = 0: a plain target step; the draft catches up later via `pending`
            draft_tokens = torch.zeros(b, 0, dtype=torch.long, device=dev)
        self._sync()
        t1 = time.perf_counter()

        # ---- verify phase
        target_len_before = self._kv_t.length
        sibling_tokens = (
            torch.stack(siblings, dim=1) if siblings else draft_tokens.new_zeros(b, 0)
        )  # (B, n_sib)
        v_ids = torch.cat(
            [
                torch.tensor([r.seq[-1] for r in rows], device=dev).unsqueeze(1),
                draft_tokens,
                sibling_tokens,
            ],
            dim=1,
        )
        v_pos = tree_positions(last_pos, k, n_sib)
        v_real = torch.ones(b, k + 1 + n_sib, dtype=torch.bool, device=dev)
        tree = tree_attention(k, n_sib, dev) if n_sib else None
        hidden = self._forward(self._target_base, self._kv_t, v_ids, v_pos, v_real, tree)
        t_logits = self._target_head(hidden)
        if self._softcap:
            t_logits = torch.tanh(t_logits / self._softcap) * self._softcap
        hit = torch.zeros(b, dtype=torch.bool, device=dev)
        if all_greedy:
            t_argmax = t_logits.argmax(dim=-1)
            num_acc, hit, next_tok = verify_greedy_siblings(t_argmax, draft_tokens, sibling_tokens)
        else:
            p = S.warp_probs(t_logits, temp, top_k, top_p)
            q_full = torch.zeros(b, k, self.target_vocab, dtype=torch.float32, device=dev)
            for j, qs in enumerate(q_subs):
                q_full[:, j].index_copy_(1, subset_ids, qs.float())
            u_acc = self._uniforms(rows, 0, k, S.STREAM_ACCEPT)
            u_res = self._uniforms(rows, 0, k + 1, S.STREAM_RESIDUAL)
            num_acc, next_tok = S.verify_rejection(p, q_full, draft_tokens, u_acc, u_res)
            t_argmax = t_logits.argmax(dim=-1) if shadow else None
        self._sync()
        t2 = time.perf_counter()

        # A sampling row that accepted all k drafts emits no bonus token: every token it
        # emits then comes from the same position-keyed draft/accept/residual draw, so a
        # seeded output does not depend on k (exactness holds either way). Its last
        # draft becomes the next step's first input, so the target drops that slot.
        bonus = torch.tensor([r.seed is None for r in rows], device=dev) | (num_acc < k)
        # ---- roll back: target keeps x_last + accepted; draft keeps pending + accepted drafts
        self._kv_t.invalidate_tail(target_len_before, num_acc + bonus.long())
        if n_sib:
            hit_rows = torch.nonzero(hit).squeeze(1)
            if hit_rows.numel():  # the accepted sibling's slot sits behind the chain's
                self._kv_t.mark_valid(hit_rows, target_len_before + 1 + k + num_acc[hit_rows])
        if k > 0:
            self._kv_d.invalidate_tail(draft_len_before + p_len, num_acc)
        draft_s, target_s = t1 - t0, t2 - t1
        self._update_timing(
            draft_s, target_s, k, first_s if p_len > 2 else None, b * (k + 1 + n_sib)
        )
        if shadow:
            # The full head for all k positions in one call, outside the timed phases:
            # a memory-bound head read once for k rows costs ~1/k of k separate reads.
            full_argmax = self.head.full_argmax(torch.stack(shadow_hidden, dim=1))
            self._shadow(comp_argmax, full_argmax, t_argmax, k, threshold, strategy, ratio)

        outputs: list[StepOutput] = []
        keep: list[int] = []
        acc_list, next_list, draft_list = num_acc.tolist(), next_tok.tolist(), draft_tokens.tolist()
        bonus_list, hit_list, sib_list = bonus.tolist(), hit.tolist(), sibling_tokens.tolist()
        for i, r in enumerate(rows):
            a = acc_list[i]
            old_len = len(r.seq)
            if k > 0:
                r.draft_seen = old_len + min(a, k - 1)
                r.est.update(a, k)
            if hit_list[i]:  # the sibling at the break, then the target's token after it
                emitted = [*draft_list[i][:a], sib_list[i][a], next_list[i]]
                self.stats.sibling_hits += 1
            else:
                emitted = draft_list[i][:a] + ([next_list[i]] if bonus_list[i] else [])
            record_request_verification(r.stats, k, a + hit_list[i])
            self.stats.record_verification(k, a + hit_list[i])
            r.stats.draft_time_s += draft_s
            r.stats.target_time_s += target_s
            new_tokens, reason = self._append(r, emitted)
            self.stats.generated_tokens += len(new_tokens)
            finished = reason is not None
            outputs.append(StepOutput(r.req.request_id, new_tokens, finished, reason))
            if finished:
                self._store_result(r, reason)
            else:
                keep.append(i)
        self.stats.batch_steps += 1
        self.stats.draft_time_s += draft_s
        self.stats.target_time_s += target_s
        self.stats.draft_forwards += k
        self.stats.target_forwards += 1
        if len(keep) != b:
            self._keep_rows(keep)
        self._kv_t.maybe_compact()
        self._kv_d.maybe_compact()
        return outputs

    def _append(self, r: _Row, emitted: list[int]) -> tuple[list[int], str | None]:
        out: list[int] = []
        for t in emitted:
            r.seq.append(t)
            out.append(t)
            if t in r.req.stop_token_ids:
                return out, "stop"
            if len(r.seq) - r.n_prompt >= r.req.max_new_tokens:
                return out, "length"
        if self._max_positions and len(r.seq) >= self._max_positions:
            return out, "length"
        return out, None

    def _uniforms(self, rows: list[_Row], offset: int, n: int, stream: int) -> torch.Tensor:
        """(B, n) uniforms for positions len(seq)+offset .. +n-1 of each sampling row."""
        u = torch.zeros(len(rows), n, dtype=torch.float64)
        for i, r in enumerate(rows):
            if r.seed is not None:
                base = len(r.seq) + offset
                u[i] = torch.tensor([S.uniform(r.seed, base + j, stream) for j in range(n)])
        return u.to(self.device)

    def _relative_costs(self) -> RelativeCosts:
        """choose_k's cost inputs for the current batch, from the timing so far."""
        vc = self._verify_cost
        return relative_costs(vc.line(), len(self._rows), self._cost_ratio, vc.single_s)

    def _update_timing(
        self, draft_s: float, target_s: float, k: int, catch_up_s: float | None, tokens: int
    ) -> None:
        """Timing for choose_k: the verification line (seconds vs tokens verified), the
        one-token step, and the draft forward over the batch's one-token verification."""
        if target_s <= 0:
            return
        if k == 0:
            self._verify_cost.observe_single(target_s)
            return
        self._verify_cost.observe(tokens, target_s)
        per_forward = draft_forward_seconds(draft_s, k, catch_up_s)
        unit = one_token_seconds(self._verify_cost.line(), len(self._rows))
        if per_forward is not None and unit is not None:
            self._cost_ratio = 0.8 * self._cost_ratio + 0.2 * per_forward / unit

    def _shadow(
        self,
        comp: list[torch.Tensor],
        full: torch.Tensor,
        t_argmax: torch.Tensor | None,
        k: int,
        threshold: float,
        strategy: str,
        ratio: float,
    ) -> None:
        if t_argmax is None:
            return
        c = torch.stack(comp, dim=1) == t_argmax[:, :k]
        f = full == t_argmax[:, :k]  # (B, k)
        for cm, fm in zip(c.flatten().tolist(), f.flatten().tolist(), strict=False):
            self.quality.add(bool(cm), bool(fm))
        kept = self.quality.kept
        self.stats.kept_acceptance = kept
        self.stats.shadow_samples = self.quality.total_samples
        ladder = sorted(set([*RATIO_LADDER, ratio]))
        new = fallback_decision(
            kept, self.quality.samples, threshold, strategy, ratio, ladder, self.shadow_min_samples
        )
        if new is not None:
            with self._settings_lock:
                if self._ratio == ratio:  # a concurrent set_compression_ratio wins
                    self._ratio = new
            self.stats.record_fallback(REASON_QUALITY)
            self.quality.reset()

    def _keep_rows(self, keep: list[int]) -> None:
        self._rows = [self._rows[i] for i in keep]
        self._kv_t.select_rows(keep)
        self._kv_d.select_rows(keep)

    def _store_result(self, r: _Row, reason: str) -> None:
        self.stats.requests_finished += 1
        self._results[r.req.request_id] = GenerationResult(
            r.req.request_id, list(r.req.prompt_ids), list(r.output), reason, r.stats
        )
