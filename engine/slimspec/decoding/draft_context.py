"""The draft's prompt window: how much of a prompt the draft model prefills.

Why: the draft only proposes; the target verifies every token against the whole
prompt, so output stays exactly the target's whatever the draft saw. Prefilling the
draft with the whole prompt costs about a sixth of a prompt's prefill with the default
pair (250-token prompts on 2 cores: ~0.19 s of ~1.35 s) and grows with the prompt. The
draft model alone accepts less with a window on code (it misses names defined above
it: first token 55% against 69% at fixed k), but with lookup drafts and adaptive k the
default engine measured within noise of whole prompts single-stream and faster in a
batch (docs/engine.md, `draft_context` under "Using it"). Lookup drafts (lookup.py)
still index the whole sequence.

`draft_context` = n keeps the last n tokens of prompt[:-1] in the draft's cache, at their
own positions (RoPE keys are relative, so the draft attends over a shorter past of the
same text); everything generated after the prompt is kept too. 0 prefills the whole
prompt (the draft's cache then holds what the target's does, and the prefix cache keeps
both models' blocks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from slimspec.decoding.settings import count_setting

DEFAULT_DRAFT_CONTEXT = 64
ENV = "SLIMSPEC_DRAFT_CONTEXT"


def resolve_draft_context(value: int | None, env: Mapping[str, str] | None = None) -> int:
    """The draft's prompt window in tokens (0: the whole prompt). None reads
    SLIMSPEC_DRAFT_CONTEXT from env (default: the process's; DEFAULT_DRAFT_CONTEXT where
    unset)."""
    env = os.environ if env is None else env
    return count_setting(
        value, env, "draft_context", ENV, DEFAULT_DRAFT_CONTEXT, "the whole prompt"
    )


def window_start(prompt_len: int, draft_context: int) -> int:
    """The first prompt position the draft's cache holds for a prompt of prompt_len
    tokens: the start of the last draft_context tokens of prompt[:-1] (0: all of it)."""
    held = max(0, prompt_len - 1)
    return max(0, held - draft_context) if draft_context else 0
