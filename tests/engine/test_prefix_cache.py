"""The prefix cache (decoding/prefix_cache.py): prompts that share a prefix with an
earlier one skip its prefill, and the output stays exactly what it is without the cache
(fp32, tiny random models; the serving gain is in bench/prefix_cache.py)."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.kv import BatchKV, forward
from slimspec.decoding.prefix_cache import PrefixCache, blocks_that_fit, resolve_mb
from slimspec.decoding.rows import right_aligned
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import run_steps, target_greedy
from tests.support.tiny_models import TINY_VOCAB, tiny_pair

BLOCK = 4
N_NEW = 12


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist()


SYSTEM = _tokens(42, seed=1)  # a shared "system prompt": 10 full blocks and 2 tokens
TURNS = [SYSTEM + _tokens(n, seed=10 + n) for n in (1, 3, 6, 13)]


def _decoder(pair, cache_mb: float = 16.0, **kw):  # type: ignore[no-untyped-def]
    target, draft = pair
    kw.setdefault("num_draft_tokens", 3)
    return SpeculativeDecoder.from_models(
        target, draft, prefix_cache_mb=cache_mb, prefix_block_tokens=BLOCK, **kw
    )


def _reqs(prompts, tag: str, n: int = N_NEW, sp: SamplingParams | None = None):  # type: ignore[no-untyped-def]
    return [
        GenerationRequest(f"{tag}{i}", p, n, sp or SamplingParams()) for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [512, 5])
def test_cached_and_uncached_runs_give_the_target_greedy_output(arch, chunk):
    """A prompt behind a cached prefix is prefilled from the cache plus its rest (in one
    forward, or in chunks when the rest is long), and decodes exactly as without it."""
    pair = tiny_pair(arch, seed=7)
    target = pair[0]
    cached, plain = _decoder(pair, prefill_chunk=chunk), _decoder(pair, 0, prefill_chunk=chunk)
    assert plain.prefix_cache is None
    first = run_steps(cached, _reqs([TURNS[0]], "first"))  # stores the system prompt's blocks
    assert cached.stats.prefix_hit_tokens == 0
    got = run_steps(cached, _reqs(TURNS, "t"))
    want = run_steps(plain, _reqs(TURNS, "t"))
    assert got == want
    for i, p in enumerate(TURNS):
        assert got[f"t{i}"] == target_greedy(target, p, N_NEW)
    assert first["first0"] == want["t0"]
    # every prompt found the system prompt's 10 blocks (TURNS[0] repeated: all of its
    # prompt[:-1] that fills blocks)
    assert cached.stats.prefix_hits == 4
    assert cached.stats.prefix_hit_tokens == 4 * 40
    assert plain.stats.prefix_hit_tokens == 0


def test_hits_ride_on_the_verification_and_stay_exact(tiny_llama_pair):
    """While rows decode, a hit's rest (with its last prompt token) rides on the
    verification forward against the cached slots."""
    dec = _decoder(tiny_llama_pair)
    target = tiny_llama_pair[0]
    run_steps(dec, _reqs([TURNS[2]], "warm"))
    busy = _reqs([_tokens(9, seed=3)], "busy", n=30)
    later = _reqs(TURNS, "t")
    before = dec.stats.fused_prefills
    got = run_steps(dec, busy, later)
    assert dec.stats.fused_prefills - before == len(later)  # every hit rode
    for r in [*busy, *later]:
        assert got[r.request_id] == target_greedy(target, list(r.prompt_ids), r.max_new_tokens)
    assert dec.stats.prefix_hits == len(later)


def test_a_batch_of_hits_and_misses_together(tiny_qwen2_pair):
    """Hits, misses, a repeat of a prompt in the same batch, a one-token prompt and a
    prompt shorter than a block, all admitted at once, then again as arrivals."""
    target = tiny_qwen2_pair[0]
    dec = _decoder(tiny_qwen2_pair)
    run_steps(dec, _reqs([TURNS[1]], "warm"))
    mix = [TURNS[0], _tokens(30, seed=5), TURNS[3], _tokens(1, seed=6), TURNS[3], [4, 5, 6]]
    got = run_steps(dec, _reqs(mix, "m"), _reqs(mix, "late"))
    for tag in ("m", "late"):
        for i, p in enumerate(mix):
            assert got[f"{tag}{i}"] == target_greedy(target, p, N_NEW), (tag, i)
    # first wave: the three TURNS hit the system prompt; second wave: everything with a
    # full block hits what the first wave stored
    assert dec.stats.prefix_hits == 3 + 4
    assert not dec.has_work() and not dec._batch.rows


def test_results_report_the_cached_prompt_tokens(tiny_llama_pair):
    dec = _decoder(tiny_llama_pair)
    [miss] = dec.generate_batch(_reqs([TURNS[3]], "a"))
    [hit] = dec.generate_batch(_reqs([TURNS[3]], "b"))
    assert miss.stats.cached_prompt_tokens == 0
    n = len(TURNS[3]) - 1  # the target cache holds prompt[:-1]: 54 tokens, 13 full blocks
    assert hit.stats.cached_prompt_tokens == n // BLOCK * BLOCK == 52
    assert hit.output_ids == miss.output_ids
    stats = dec.stats.as_dict()
    assert stats["prefix_hit_tokens"] == 52 and stats["prefix_lookups"] == 2
    assert stats["prefix_cache_blocks"] == 13 and stats["prefix_cache_bytes"] > 0


def test_eviction_keeps_the_cache_within_its_bytes_and_the_output_exact(tiny_llama_pair):
    target = tiny_llama_pair[0]
    probe = _decoder(tiny_llama_pair)
    probe.generate_batch(_reqs([[*SYSTEM, 3]], "p"))
    block_bytes = probe.stats.prefix_cache_bytes // probe.stats.prefix_cache_blocks
    dec = _decoder(tiny_llama_pair, cache_mb=12.5 * block_bytes / 2**20)  # 12 blocks
    prompts = [_tokens(30, seed=s) for s in range(20, 26)]  # 7 blocks each
    got = run_steps(dec, _reqs(prompts, "a"))
    cache = dec.prefix_cache
    assert cache is not None
    held = cache.stats()
    assert held.bytes <= cache.max_bytes and held.blocks <= 12
    assert dec.stats.prefix_evictions == held.evictions > 0
    assert dec.stats.prefix_cache_bytes == held.bytes
    # the most recent prompt is still whole; the first ones were evicted
    again = run_steps(dec, _reqs([prompts[-1], prompts[0]], "b"))
    assert dec.stats.prefix_hit_tokens == 28
    for i, p in enumerate(prompts):
        assert got[f"a{i}"] == target_greedy(target, p, N_NEW)
    assert again["b0"] == got["a5"] and again["b1"] == got["a0"]


def test_seeded_sampling_is_the_same_with_and_without_the_cache(tiny_llama_pair):
    sp = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, seed=4321)
    cached, plain = _decoder(tiny_llama_pair), _decoder(tiny_llama_pair, 0)
    run_steps(cached, _reqs([TURNS[0]], "warm"))
    busy = _reqs([_tokens(7, seed=8)], "busy", n=20)
    got = run_steps(cached, busy, _reqs(TURNS, "s", sp=sp))
    want = run_steps(plain, busy, _reqs(TURNS, "s", sp=sp))
    assert cached.stats.prefix_hits == len(TURNS)
    assert got == want


def test_the_size_can_change_at_run_time_and_a_new_cache_starts_empty(tiny_llama_pair):
    dec = _decoder(tiny_llama_pair)
    dec.generate_batch(_reqs([TURNS[0]], "a"))
    assert dec.stats.prefix_cache_blocks == 10
    dec.set_prefix_cache_mb(0)
    assert dec.prefix_cache is None and dec.stats.prefix_cache_bytes == 0
    dec.generate_batch(_reqs([TURNS[0]], "b"))
    assert dec.stats.prefix_hits == 0
    dec.set_prefix_cache_mb(1)
    dec.generate_batch(_reqs([TURNS[0]], "c"))
    assert dec.stats.prefix_hits == 0 and dec.stats.prefix_cache_blocks == 10
    # off and on again keeps what it holds
    assert not dec.set_prefix_cache_on(False)
    dec.generate_batch(_reqs([TURNS[0]], "d"))
    assert dec.stats.prefix_hits == 0 and dec.stats.prefix_cache_bytes == 0
    assert dec.set_prefix_cache_on(True)
    dec.generate_batch(_reqs([TURNS[0]], "e"))
    assert dec.stats.prefix_hits == 1 and dec.stats.prefix_cache_blocks == 10


def test_size_setting(monkeypatch):
    assert resolve_mb(64, {}) == 64
    assert resolve_mb(None, {"SLIMSPEC_PREFIX_CACHE_MB": "0"}) == 0
    assert resolve_mb(None, {"SLIMSPEC_PREFIX_CACHE_MB": " 12.5 "}) == 12.5
    assert resolve_mb(None, {}) > 0  # on by default
    for bad in ("-1", "lots"):
        with pytest.raises(ValueError, match="MiB"):
            resolve_mb(None, {"SLIMSPEC_PREFIX_CACHE_MB": bad})
    monkeypatch.setenv("SLIMSPEC_PREFIX_CACHE_MB", "0")
    target, draft = tiny_pair("llama", seed=2)
    assert SpeculativeDecoder.from_models(target, draft).prefix_cache is None


# ------------------------------------------------------------------ the store itself
def _slots(n: int, fill: float) -> torch.Tensor:
    return torch.full((2, 2, 1, n, 3), fill)  # (layers, k/v, heads, tokens, dim)


def _extract(tokens, fill: float = 0.0):  # type: ignore[no-untyped-def]
    """Slots whose values are fill + token index (so blocks can be told apart)."""

    def extract(start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(start, end, dtype=torch.float32).view(1, 1, 1, -1, 1)
        t = _slots(end - start, fill) + idx
        return t, t * 2

    return extract


def test_blocks_are_found_only_behind_the_same_tokens():
    cache = PrefixCache(1 << 20, block_tokens=2)
    a = [1, 2, 3, 4, 5, 6, 7]
    assert cache.store(a, _extract(a)) == 6  # three full blocks
    assert cache.lookup(a).tokens == 6
    assert cache.lookup([1, 2, 3, 4, 9, 9]).tokens == 4
    assert cache.lookup([9, 9, 3, 4, 5, 6]).tokens == 0  # same blocks, other parent
    assert cache.lookup([1]).tokens == 0
    hit = cache.lookup([1, 2, 3, 4])
    assert hit.target is not None and hit.draft is not None
    assert hit.target[0, 0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.equal(hit.draft, hit.target * 2)
    # only the missing blocks are extracted and stored
    seen: list[tuple[int, int]] = []

    def spy(start: int, end: int):  # type: ignore[no-untyped-def]
        seen.append((start, end))
        return _extract(a)(start, end)

    assert cache.store([1, 2, 3, 4, 5, 6, 8, 8], spy) == 2 and seen == [(6, 8)]
    s = cache.stats()
    assert (s.lookups, s.hits, s.hit_tokens, s.blocks, s.stored_tokens) == (5, 3, 14, 4, 8)


def test_stored_blocks_are_copies():
    cache = PrefixCache(1 << 20, block_tokens=2)
    src = _slots(4, 1.0)
    cache.store([1, 2, 3, 4], lambda s, e: (src[:, :, :, s:e], src[:, :, :, s:e]))
    src.fill_(-7.0)  # a batch's cache edited in place later
    hit = cache.lookup([1, 2, 3, 4])
    assert hit.target is not None and bool((hit.target == 1.0).all())


def test_least_recently_used_leaves_go_first():
    cache = PrefixCache(1 << 20, block_tokens=1)
    a, b = [1, 2, 3], [1, 5]
    cache.store(a, _extract(a))
    cache.store(b, _extract(b))
    one = cache.stats().bytes // 4  # blocks: 1, 1-2, 1-2-3, 1-5
    cache.lookup(a)  # a's path is now the most recent: 1-5 is the oldest leaf
    cache.max_bytes = 4 * one
    cache.store([7], _extract([7]))  # over the bound by one block
    assert cache.lookup([1, 5]).tokens == 1  # its leaf went, its parent (shared) stays
    assert cache.lookup(a).tokens == 3 and cache.lookup([7]).tokens == 1
    assert cache.stats().evictions == 1
    # a bound below one prompt's path: the prompt keeps its first blocks
    small = PrefixCache(2 * one, block_tokens=1)
    assert small.store([1, 2, 3, 4], _extract([1, 2, 3, 4])) == 2
    assert small.lookup([1, 2, 3, 4]).tokens == 2
    small.clear()
    assert small.lookup([1, 2]).tokens == 0 and small.stats().bytes == 0


def test_blocks_that_fit():
    assert blocks_that_fit(100, 10, 0, 5) == 5
    assert blocks_that_fit(100, 10, 8, 5) == 2
    assert blocks_that_fit(100, 10, 12, 5) == 0
    assert blocks_that_fit(5, 10, 0, 5) == 0


@torch.inference_mode()
def test_row_slots_round_trip_through_from_slots(tiny_llama_pair):
    """A row's valid slots (holes skipped) rebuild a cache that continues the prompt as
    the original cache does."""
    base = tiny_llama_pair[0].get_decoder()
    kv = BatchKV("cpu")
    seqs = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    forward(base, kv, *right_aligned(seqs, [0, 0]))
    slots = kv.row_slots(1, 0, 3)  # row 1 sits behind 4 padding holes
    assert slots.shape[:2] == (2, 2) and slots.shape[3] == 3
    rebuilt = BatchKV.from_slots("cpu", base.config, slots)
    alone = BatchKV("cpu")
    forward(base, alone, *right_aligned([seqs[1]], [0]))
    nxt = (torch.tensor([[20]]), torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(forward(base, rebuilt, *nxt), forward(base, alone, *nxt))
    with pytest.raises(ValueError):
        kv.row_slots(1, 0, 4)


@pytest.mark.parametrize("arch", ["qwen2"])
def test_a_gguf_served_target_gives_the_same_tokens_cached_in_bf16(arch, tmp_path):
    """The target served from its GGUF blocks reads the cache through the row-by-row
    attention: cached slots give bit for bit what its own prefill gives, so greedy output
    equals the served target's, cached or not, in bf16 with no tie tolerance."""
    from slimspec.cpu import gguf_kernels, target_form
    from transformers import AutoModelForCausalLM

    from tests.engine.helpers import target_only
    from tests.support.tiny_gguf import write_tiny_gguf_model
    from tests.support.tiny_models import noisy_copy

    if gguf_kernels.load() is None:
        pytest.skip("no C compiler here")
    path = write_tiny_gguf_model(tmp_path, arch)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert target_form.apply(target, "gguf", path).quantization == "gguf"
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    draft = noisy_copy(dense, noise=0.3).to(torch.bfloat16)
    dec = _decoder((target, draft))
    vocab = target.config.vocab_size
    system = [t % vocab for t in SYSTEM]
    prompts = [system + [t % vocab for t in _tokens(n, seed=n)] for n in (1, 5, 9)]
    dec.generate_batch(_reqs([prompts[0]], "warm"))
    busy = _reqs([[5, 9, 11]], "busy", n=24)
    got = run_steps(dec, busy, _reqs(prompts, "t"))
    assert dec.stats.prefix_hits == len(prompts)
    want = target_only(target, [*busy, *_reqs(prompts, "t")])
    assert [got[r.request_id] for r in [*busy, *_reqs(prompts, "t")]] == want
