"""What the server runs: one typed interface of the speculative decoder and the
target-only baseline (server/baseline.py).

`StepEngine` is the step-wise request API the scheduler drives; `Engine` adds what
the service and the metrics read and the runtime settings they set. Both engines
implement all of it, so the server calls methods, never looks them up by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from slimspec.cpu.target_form import TargetForm
from slimspec.decoding.ratio_monitor import RatioReport
from slimspec.decoding.stats import DecoderStats
from slimspec.decoding.types import GenerationRequest, StepOutput
from slimspec.draft_head.traffic import RankingStatus

# The compression ratio an engine without a draft head reports: nothing of a draft's
# scoring is removed because nothing is drafted (docs/contracts.md).
NO_DRAFT_RATIO = 0.0


@dataclass(frozen=True)
class DraftHeadInfo:
    """Which draft head an engine serves: calibrated by an artifact (its directory, ""
    for one given in memory) or the uncalibrated fallback."""

    calibrated: bool
    artifact: str


class StepEngine(Protocol):
    """The step-wise decoder interface the scheduler drives."""

    def add_request(self, req: GenerationRequest) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def step(self) -> list[StepOutput]: ...
    def has_work(self) -> bool: ...


class Engine(StepEngine, Protocol):
    """A loaded model version as the server uses it."""

    tokenizer: Any  # what the routes encode prompts with
    stats: DecoderStats  # cumulative; the metrics diff it after each step
    target_form: TargetForm  # what the target's weights are served from (cpu/target_form.py)

    @property
    def max_context(self) -> int | None:
        """Most tokens (prompt + generated) a request may hold (None: no known limit)."""
        ...

    @property
    def compression_ratio(self) -> float:
        """The ratio in force (after quality fallbacks); NO_DRAFT_RATIO without a draft."""
        ...

    @property
    def lookup_tokens(self) -> int:
        """The most tokens a lookup draft proposes (decoding/lookup.py; 0: none)."""
        ...

    @property
    def draft_context(self) -> int:
        """The most prompt tokens the draft prefills (decoding/draft_context.py; 0: whole
        prompts, or no draft)."""
        ...

    @property
    def ratio_report(self) -> RatioReport | None:
        """The latest prediction of what each ratio costs and buys (None: none yet, or
        no draft head)."""
        ...

    def ranking_status(self) -> RankingStatus | None:
        """Where the head's token ranking comes from (None: no draft head)."""
        ...

    def draft_head_info(self) -> DraftHeadInfo | None:
        """The draft head served (None: no draft head)."""
        ...

    def stop_token_ids(self) -> frozenset[int]:
        """The ids a request stops at by default (chat models end on several)."""
        ...

    def warmup(self) -> None:
        """A short generation so the first requests do not pay one-off costs."""
        ...

    def check_grammar(self, grammar: str) -> None:
        """ValueError for a grammar this engine cannot follow; otherwise it is compiled
        against the tokenizer once (the first structured request pays seconds there, on
        the caller's thread, not inside a batch step)."""
        ...

    # Runtime settings (docs/contracts.md: the runtime ConfigMap's keys); called on the
    # scheduler thread between steps. An engine without a draft has nothing to compress
    # or check: it accepts them and keeps reporting what is in force.
    def set_compression_ratio(self, ratio: float) -> None: ...
    def set_quality_threshold(self, threshold: float) -> None: ...
    def set_fallback_strategy(self, strategy: str) -> None: ...


def eos_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """EOS ids of the tokenizer (None: the engine takes token ids only) and of the
    model's generation config (chat models end on several)."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = model.generation_config
    eos = config.eos_token_id if config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list | tuple):
        ids.update(int(i) for i in eos)
    return frozenset(ids)
