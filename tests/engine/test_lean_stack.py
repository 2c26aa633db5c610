"""The decoder stack's lean loop (cpu/lean_stack.py) for a target served from its GGUF
blocks, on the tiny GGUF models (tests/support/tiny_gguf.py).

What users rely on: it changes where the time goes, not a single value. The engine's
calls (a batch with holes, explicit positions and a tree of drafts; a plain cache; no
cache) give the per-layer path's hidden states bit for bit, a prefill that fills only
the caches leaves them as a full forward does, and calls the loop does not
cover (hidden states asked for, hooks on a layer, the layers made plain again) run the
model's own forward and get what it gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from slimspec.cpu import gguf_kernels, lean_layers, lean_stack, target_form
from slimspec.decoding.kv import BatchKV, fill_caches, forward
from transformers import AutoModelForCausalLM, DynamicCache

from tests.support.tiny_gguf import write_tiny_gguf_model

pytestmark = pytest.mark.skipif(gguf_kernels.load() is None, reason="no C compiler here")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def served(request, tmp_path_factory):
    path: Path = write_tiny_gguf_model(tmp_path_factory.mktemp(request.param), request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert target_form.apply(model, "gguf", path).quantization == "gguf"
    assert isinstance(vars(model.model).get("lean"), lean_stack.LeanStack)
    return model


def count_layer_calls(model) -> list[int]:
    """Make the decoder layers' own forwards count their calls (none on the lean loop)."""
    calls: list[int] = []
    for layer in model.model.layers:
        inner = vars(layer)["forward"]

        def counted(*a, inner=inner, **kw):
            calls.append(1)
            return inner(*a, **kw)

        vars(layer)["forward"] = counted
    return calls


@pytest.fixture
def layer_calls(served):
    yield count_layer_calls(served)
    lean_layers.undo(served)  # fresh lean layers, without the counting
    lean_layers.use_for(served)


def both_ways(model, run):
    """run() on the lean loop, then on the per-layer path (the stack's own forward)."""
    lean = run()
    assert lean_stack.undo(model)
    try:
        plain = run()
    finally:
        assert lean_stack.use_for(model)
    return lean, plain


def engine_steps(model) -> list[torch.Tensor]:
    """What the engine does to its target: two rows with a padding hole prefilled, a
    verification of 4 slots with one rejected draft rolled back, a tree of drafts."""
    base = model.model
    kv = BatchKV("cpu")
    ids = torch.tensor([[0, 5, 9, 11, 13], [7, 8, 3, 4, 6]])
    real = torch.tensor([[False, True, True, True, True], [True] * 5])
    pos = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
    with torch.inference_mode():
        out = [forward(base, kv, ids, pos, real)]
        step = torch.tensor([[14, 15, 16, 17], [9, 10, 11, 12]])
        out.append(
            forward(
                base, kv, step, pos[:, -1:] + torch.arange(1, 5), torch.ones(2, 4, dtype=torch.bool)
            )
        )
        kv.invalidate_tail(5, torch.tensor([2, 4]))
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        out.append(
            forward(
                base,
                kv,
                torch.tensor([[3, 4, 5], [6, 7, 8]]),
                torch.tensor([[6, 7, 7], [9, 10, 10]]),
                torch.ones(2, 3, dtype=torch.bool),
                tree,
            )
        )
    return out


def test_the_engines_calls_get_the_per_layer_paths_values(served, layer_calls):
    lean, plain = both_ways(served, lambda: engine_steps(served))
    for got, want in zip(lean, plain, strict=True):
        assert torch.equal(got, want)
    n_layers = len(served.model.layers)
    assert len(layer_calls) == 3 * n_layers  # the per-layer run only: the lean loop ran


def test_a_plain_cache_and_no_cache_give_the_per_layer_paths_logits(served, layer_calls):
    def run() -> list[torch.Tensor]:
        cache = DynamicCache(config=served.config)
        with torch.inference_mode():
            first = served(torch.tensor([[5, 9, 11, 3, 4]]), cache=cache, use_cache=True).logits
            step = served(torch.tensor([[7]]), cache=cache, use_cache=True).logits
            many = served(torch.tensor([[8, 9, 10]]), cache=cache, use_cache=True).logits
            alone = served(torch.tensor([[5, 9, 11], [1, 2, 3]]), use_cache=False).logits
        return [first, step, many, alone]

    lean, plain = both_ways(served, run)
    assert all(torch.equal(a, b) for a, b in zip(lean, plain, strict=True))
    assert len(layer_calls) == 4 * len(served.model.layers)


def test_what_the_loop_does_not_cover_runs_the_models_forward(served, layer_calls):
    ids = torch.tensor([[5, 9, 11, 3]])
    n_layers = len(served.model.layers)
    with torch.inference_mode():
        want = served(ids).logits
        assert not layer_calls
        out = served(ids, output_hidden_states=True)
        assert len(layer_calls) == n_layers and len(out.hidden_states) == n_layers + 1
        assert torch.equal(out.logits, want)
        seen = []
        hook = served.model.layers[0].register_forward_hook(lambda *_: seen.append(1))
        try:
            assert torch.equal(served(ids).logits, want)
        finally:
            hook.remove()
        assert seen == [1] and len(layer_calls) == 2 * n_layers
    # layers made plain again, then lean again: the loop follows them
    lean_layers.undo(served)
    with torch.inference_mode():
        assert torch.equal(served(ids).logits, want)
    lean_layers.use_for(served)
    calls = count_layer_calls(served)
    with torch.inference_mode():
        assert torch.equal(served(ids).logits, want)
    assert not calls
    lean_stack.undo(served)
    try:
        with torch.inference_mode():
            assert torch.equal(served(ids).logits, want)
    finally:
        lean_stack.use_for(served)
    assert len(calls) == n_layers  # the counting works: the loop above did not call them


def cache_tensors(kv: BatchKV) -> list[torch.Tensor]:
    assert kv.cache is not None
    return [t for layer in kv.cache.layers for t in (layer.keys, layer.values)]


def test_a_prefill_that_fills_only_the_caches_leaves_what_a_forward_leaves(served, monkeypatch):
    """fill_caches (the engine's prefills): the last layer stops after its keys and
    values (one layer_post fewer), and the caches, the next verification's hidden
    states included, are bit for bit those of a full forward."""
    posts: list[int] = []
    layer_post = gguf_kernels.layer_post

    def counted(*a, **kw):
        posts.append(1)
        return layer_post(*a, **kw)

    monkeypatch.setattr(gguf_kernels, "layer_post", counted)
    base, n_layers = served.model, len(served.model.layers)
    ids = torch.tensor([[0, 5, 9, 11, 13], [7, 8, 3, 4, 6]])
    real = torch.tensor([[False, True, True, True, True], [True] * 5])
    pos = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
    step = torch.tensor([[14, 15], [9, 10]]), pos[:, -1:] + torch.arange(1, 3)
    full, filled = BatchKV("cpu"), BatchKV("cpu")
    with torch.inference_mode():
        forward(base, full, ids, pos, real)
        prefilled = [t.clone() for t in cache_tensors(full)]
        assert len(posts) == n_layers
        fill_caches(base, filled, ids, pos, real)
        assert len(posts) == 2 * n_layers - 1
        assert torch.equal(full.valid, filled.valid)
        assert all(
            torch.equal(a, b)
            for a, b in zip(cache_tensors(full), cache_tensors(filled), strict=True)
        )
        after = [
            forward(base, kv, *step, torch.ones(2, 2, dtype=torch.bool)) for kv in (full, filled)
        ]
    assert torch.equal(after[0], after[1])
    # without the lean loop the stack's own forward fills them, whole
    assert lean_stack.undo(served)
    try:
        plain = BatchKV("cpu")
        with torch.inference_mode():
            fill_caches(base, plain, ids, pos, real)
    finally:
        assert lean_stack.use_for(served)
    assert all(torch.equal(a, b) for a, b in zip(prefilled, cache_tensors(plain), strict=True))


def test_a_few_row_step_runs_every_layer_in_one_call_with_the_loops_bits(served, monkeypatch):
    """Steps of at most STEP_ROWS rows against a cache with room run all layers in one
    native call (gguf_kernels.layers_step) that writes the keys and values into the
    room: the engine's calls (holes, a rollback, a tree of drafts), a compaction and
    rooms outgrown give the per-layer loop's hidden states and caches bit for bit."""
    from slimspec.decoding import kv as kv_module

    monkeypatch.setattr(kv_module, "GROW_MIN", 1)  # rooms made anew every few steps
    steps: list[int] = []
    real_step = gguf_kernels.layers_step

    def counted(*a, **kw):
        steps.append(1)
        return real_step(*a, **kw)

    monkeypatch.setattr(gguf_kernels, "layers_step", counted)

    def run() -> tuple[list[torch.Tensor], BatchKV]:
        out = engine_steps(served)
        kv = BatchKV("cpu")
        ids = torch.tensor([[0, 5, 9], [7, 8, 3]])
        real = torch.tensor([[False, True, True], [True] * 3])
        pos = torch.tensor([[0, 0, 1], [0, 1, 2]])
        ones = torch.ones(2, 1, dtype=torch.bool)
        with torch.inference_mode():
            forward(served.model, kv, ids, pos, real)
            for j in range(5):
                step = torch.tensor([[11 + j], [4 + j]])
                out.append(forward(served.model, kv, step, pos[:, -1:] + 1 + j, ones))
            kv.invalidate_tail(kv.length - 2, torch.tensor([0, 2]))
            kv.compact()
            out.append(
                forward(served.model, kv, torch.tensor([[1], [2]]), torch.tensor([[5], [8]]), ones)
            )
        return out + cache_tensors(kv), kv

    one_call, _ = run()
    used = len(steps)
    monkeypatch.setattr(lean_stack, "STEP_ROWS", 0)
    loop, _ = run()
    assert used == 8 and len(steps) == used  # the second run: the per-layer loop only
    assert len(one_call) == len(loop)
    assert all(torch.equal(a, b) for a, b in zip(one_call, loop, strict=True))
