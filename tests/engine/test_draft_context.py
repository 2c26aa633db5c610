"""The draft's prompt window (decoding/draft_context.py): the draft prefills only the last
`draft_context` tokens of a prompt, the target the whole of it, and the output stays
exactly the target's on every prefill path (whole prompts, chunks, riding on a
verification, prefix-cache hits) and for seeded sampling (fp32, tiny random models)."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.draft_context import (
    DEFAULT_DRAFT_CONTEXT,
    resolve_draft_context,
    window_start,
)
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import prompts, run_steps, target_greedy
from tests.support.tiny_models import TINY_VOCAB

WINDOW = 5
N_NEW = 10


def _decoder(pair, window: int = WINDOW, **kw):  # type: ignore[no-untyped-def]
    target, draft = pair
    kw.setdefault("num_draft_tokens", 3)
    kw.setdefault("lookup_tokens", 0)  # every step drafts with the draft model
    kw.setdefault("prefix_cache_mb", 0)
    return SpeculativeDecoder.from_models(target, draft, draft_context=window, **kw)


def _draft_widths(dec: SpeculativeDecoder) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """The tokens (padding included) of every forward of the draft's decoder stack."""
    seen: list[int] = []

    def hook(_m, args, kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(int(ids.shape[1]))

    return seen, dec._batch._draft_base.register_forward_pre_hook(hook, with_kwargs=True)


def _reqs(ps, tag: str, n: int = N_NEW, sp: SamplingParams | None = None):  # type: ignore[no-untyped-def]
    return [GenerationRequest(f"{tag}{i}", p, n, sp or SamplingParams()) for i, p in enumerate(ps)]


def test_setting_from_argument_env_and_default():
    assert resolve_draft_context(None, {}) == DEFAULT_DRAFT_CONTEXT
    assert resolve_draft_context(None, {"SLIMSPEC_DRAFT_CONTEXT": "0"}) == 0
    assert resolve_draft_context(32, {"SLIMSPEC_DRAFT_CONTEXT": "7"}) == 32
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ValueError, match="SLIMSPEC_DRAFT_CONTEXT"):
            resolve_draft_context(None, {"SLIMSPEC_DRAFT_CONTEXT": bad})
    for value in (-3, True, 2.0):
        with pytest.raises(ValueError, match="draft_context"):
            resolve_draft_context(value, {})  # type: ignore[arg-type]


def test_window_start_keeps_the_last_tokens_of_the_prompt_before_its_last():
    assert window_start(100, 5) == 94  # prompt[:-1] is 99 tokens: positions 94..98
    assert window_start(6, 5) == 0 and window_start(7, 5) == 1
    assert window_start(1, 5) == window_start(0, 5) == 0
    assert window_start(100, 0) == 0  # 0: the whole prompt


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_prompts_decode_as_the_target_and_the_draft_prefills_its_window(arch, request):
    pair = request.getfixturevalue(f"tiny_{arch}_pair")
    dec = _decoder(pair)
    seen, handle = _draft_widths(dec)
    ps = prompts(5, TINY_VOCAB, seed=3, lengths=(1, 2, 6, 30, 61))
    try:
        got = run_steps(dec, _reqs(ps, "r"))
    finally:
        handle.remove()
    assert seen[0] == WINDOW  # one forward for the batch: the longest window, not 60 tokens
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == target_greedy(pair[0], p, N_NEW), i
    # the draft's cache never held more of a prompt than its window, plus what followed
    assert dec._batch.draft_kv.length <= WINDOW + 4 * N_NEW


def test_the_window_matters_to_the_draft_only():
    """Same greedy text with the whole prompt, a window of 1 and the default; the draft's
    widest prefill follows the window."""
    from tests.support.tiny_models import tiny_pair

    pair = tiny_pair("llama", seed=11)
    p = prompts(1, TINY_VOCAB, seed=4, lengths=(80,))[0]
    outs, widest = [], []
    for window in (0, 1, DEFAULT_DRAFT_CONTEXT):
        dec = _decoder(pair, window)
        seen, handle = _draft_widths(dec)
        try:
            outs.append(dec.generate(p, N_NEW, stop_token_ids=[]).output_ids)
        finally:
            handle.remove()
        widest.append(seen[0])
    assert outs[0] == outs[1] == outs[2] == target_greedy(pair[0], p, N_NEW)
    assert widest == [79, 1, DEFAULT_DRAFT_CONTEXT]


def test_chunked_prefill_feeds_the_draft_only_the_chunks_window(tiny_llama_pair):
    dec = _decoder(tiny_llama_pair, prefill_chunk=8)
    seen, handle = _draft_widths(dec)
    ps = prompts(2, TINY_VOCAB, seed=8, lengths=(37, 100))
    try:
        got = run_steps(dec, _reqs(ps, "c"))
    finally:
        handle.remove()
    for i, p in enumerate(ps):
        assert got[f"c{i}"] == target_greedy(tiny_llama_pair[0], p, N_NEW)
    # prefill forwards of the draft: chunks cut to what reaches into each window
    assert sum(seen) < 37 + 100
    assert max(seen) <= 8


def test_prompts_riding_on_the_verification_decode_as_the_target(tiny_qwen2_pair):
    dec = _decoder(tiny_qwen2_pair)
    busy = _reqs(prompts(1, TINY_VOCAB, seed=2, lengths=(9,)), "busy", n=30)
    later = _reqs(prompts(3, TINY_VOCAB, seed=5, lengths=(3, 25, 48)), "late")
    got = run_steps(dec, busy, later)
    assert dec.stats.fused_prefills >= len(later)  # they rode (where the target can)
    for r in [*busy, *later]:
        assert got[r.request_id] == target_greedy(
            tiny_qwen2_pair[0], list(r.prompt_ids), r.max_new_tokens
        )


@pytest.mark.parametrize("chunk", [512, 6])
def test_prefix_cache_hits_keep_the_targets_blocks_and_the_draft_prefills_its_window(
    tiny_llama_pair, chunk
):
    """With a window the prefix cache keeps the target's blocks alone; a hit (partial, or
    all of prompt[:-1]) starts the target from them and the draft from its window."""
    system = prompts(1, TINY_VOCAB, seed=1, lengths=(40,))[0]
    turns = [[*system, 7], system + prompts(1, TINY_VOCAB, seed=9, lengths=(13,))[0]]
    dec = _decoder(tiny_llama_pair, prefix_cache_mb=16, prefix_block_tokens=4, prefill_chunk=chunk)
    first = run_steps(dec, _reqs(turns[:1], "first"))
    cache = dec.prefix_cache
    assert cache is not None
    hit = cache.lookup(system)
    assert hit.tokens == 40 and hit.target is not None and hit.draft is None
    got = run_steps(dec, _reqs(turns, "t"))
    assert dec.stats.prefix_hits == 2  # (the lookup above is the cache's own count)
    for i, p in enumerate(turns):
        assert got[f"t{i}"] == target_greedy(tiny_llama_pair[0], p, N_NEW), i
    assert first["first0"] == got["t0"]
    # riding hits too: one row decoding while the turns arrive
    busy = _reqs([[5, 6, 7]], "busy", n=25)
    got = run_steps(dec, busy, _reqs(turns, "late"))
    for i, p in enumerate(turns):
        assert got[f"late{i}"] == target_greedy(tiny_llama_pair[0], p, N_NEW), i


def test_without_a_window_the_prefix_cache_keeps_both_models_blocks(tiny_llama_pair):
    system = prompts(1, TINY_VOCAB, seed=1, lengths=(40,))[0]
    dec = _decoder(tiny_llama_pair, 0, prefix_cache_mb=16, prefix_block_tokens=4)
    assert dec.draft_context == 0
    run_steps(dec, _reqs([[*system, 7]], "first"))
    assert dec.prefix_cache is not None
    hit = dec.prefix_cache.lookup(system)
    assert hit.target is not None and hit.draft is not None


def test_seeded_sampling_gives_the_same_text_whatever_the_window(tiny_llama_pair):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    ps = prompts(2, TINY_VOCAB, seed=6, lengths=(33, 70))
    outs = [run_steps(_decoder(tiny_llama_pair, w), _reqs(ps, "s", 16, sp)) for w in (0, 2, WINDOW)]
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize("chunk", [512, 6])
def test_a_window_as_long_as_the_prompt_drafts_as_the_whole_prompt(tiny_llama_pair, chunk):
    """The window's slots sit at the prompt's own positions on every path: a window that
    covers each prompt, fed from scratch after a prefix-cache hit, in chunks or riding,
    drafts exactly what the whole-prompt draft does (same acceptance, token for token)."""
    system = prompts(1, TINY_VOCAB, seed=1, lengths=(40,))[0]
    turns = [system + p for p in prompts(3, TINY_VOCAB, seed=12, lengths=(1, 9, 20))]
    common = {"prefill_chunk": chunk, "prefix_block_tokens": 4, "adaptive_skip": False}
    whole = _decoder(tiny_llama_pair, 0, **common)
    covering = _decoder(tiny_llama_pair, 1000, prefix_cache_mb=16, **common)
    run_steps(covering, _reqs([[*system, 3]], "warm"))  # stores the system prompt's blocks
    busy = _reqs([[5, 6, 7]], "busy", n=20)
    runs = []
    for dec in (whole, covering):
        dec.stats = type(dec.stats)()
        runs.append((run_steps(dec, busy, _reqs(turns, "t")), dec.stats))
    (got_whole, s_whole), (got_covering, s_covering) = runs
    assert got_whole == got_covering
    assert s_covering.prefix_hits == len(turns)
    assert s_whole.drafted == s_covering.drafted > 0
    assert s_whole.accepted_per_position == s_covering.accepted_per_position
