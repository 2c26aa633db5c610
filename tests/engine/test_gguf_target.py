"""The target served from its GGUF blocks (cpu/target_form.py), on a tiny model whose
weights come from a GGUF file beside it (tests/support/tiny_gguf.py).

What users rely on: the form is the one asked for (or `auto`'s choice, said in the log),
and speculation stays exact for the target as served in bf16: token for token
(greedy) and for seeded sampling, whatever k, alone or inside a batch. The kernels'
integer sums and the row-by-row attention make a position's logits independent of what
is verified beside it, so no tie tolerance is needed here (test_gguf_kernels.py checks
the kernels themselves; tests/engine/test_gguf_real_target.py the real pair)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import gguf_kernels, lean_layers, target_form
from slimspec.decoding.types import GenerationRequest, SamplingParams
from transformers import AutoModelForCausalLM, DynamicCache

from tests.engine.helpers import target_only
from tests.support.tiny_gguf import write_tiny_gguf_model
from tests.support.tiny_models import noisy_copy

pytestmark = pytest.mark.skipif(gguf_kernels.load() is None, reason="no C compiler here")
PROMPTS = [[5, 9, 11], [7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41]]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def gguf_dir(request, tmp_path_factory) -> Path:
    return write_tiny_gguf_model(tmp_path_factory.mktemp(request.param), request.param)


def load(path: Path, dtype: torch.dtype = torch.bfloat16):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.fixture(scope="module")
def served(gguf_dir):
    """(target in its GGUF form, bf16; a dense bf16 draft)."""
    model = load(gguf_dir)
    form = target_form.apply(model, "gguf", gguf_dir)
    assert form.quantization == "gguf"
    draft = noisy_copy(load(gguf_dir, torch.float32), noise=0.3).to(torch.bfloat16)
    return model, draft


def test_every_weight_is_served_from_the_files_blocks(gguf_dir):
    model = load(gguf_dir)
    form = target_form.apply(model, "gguf", gguf_dir)
    assert form.quantization == "gguf" and "Q4_K x10" in form.detail and "Q6_K x5" in form.detail
    assert "Q8_0 x1" in form.detail  # the token table
    kinds = [type(m).__name__ for m in model.modules()]
    assert "Linear" not in kinds and "Embedding" not in kinds
    assert kinds.count("GGUFLinear") == 15 and kinds.count("GGUFEmbedding") == 1
    gguf_bytes = (gguf_dir / "tiny.gguf").stat().st_size
    # the file's blocks, not a dense copy (Q4_K's resident panels add 32 bytes per 1152)
    assert form.weight_bytes <= 1.03 * gguf_bytes
    assert ("Q4_K and Q6_K kept in 8-row panels" in form.detail) == gguf_kernels.panels_wanted()
    assert model.config._attn_implementation == "slimspec_rowwise"


def test_logits_are_the_dequantised_models_up_to_int8_activations(gguf_dir):
    reference = load(gguf_dir, torch.float32)
    model = load(gguf_dir, torch.float32)
    target_form.apply(model, "gguf", gguf_dir)
    ids = torch.tensor([PROMPTS[2] * 3])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_a_tied_head_reads_the_token_tables_blocks_once(tmp_path):
    """A tied head (no output tensor in the file) is served from the token table's
    blocks in the file's layout: not repacked into panels beside the table, which
    would hold the table twice; its logits are the dequantised model's."""
    path = write_tiny_gguf_model(tmp_path, "qwen2", tied=True)
    reference = load(path, torch.float32)
    model = load(path, torch.float32)
    form = target_form.apply(model, "gguf", path)
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.ggml_type == gguf_kernels.Q6_K and head.blocks is table.blocks
    assert form.weight_bytes <= 1.03 * (path / "tiny.gguf").stat().st_size
    ids = torch.tensor([PROMPTS[2] * 3])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_a_positions_logits_do_not_depend_on_the_rows_beside_it(served):
    model, _ = served
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        full = model(ids).logits
        for cut in (1, 4, 9):
            assert torch.equal(model(ids[:, :-cut]).logits, full[:, :-cut])
        batch = model(torch.tensor([PROMPTS[2], PROMPTS[2][::-1]])).logits
    assert torch.equal(batch[:1], full)


def test_the_lean_layers_compute_what_the_modules_compute(served, monkeypatch):
    """lean_layers.py drops the modules' dispatch, not their arithmetic: a prefill and a
    3-token step on its cache give the modules' logits bit for bit, and the modules
    inside a layer (its norms here) are not called on the lean path. The glued layers
    (native norm, RoPE and MLP glue in bf16) give the same logits up to the norms' sum
    order and SiLU's exp, and run for the served bf16 target."""
    model, _ = served
    layers = model.model.layers
    norm_calls, glue_calls = [], []
    hooks = [
        layer.input_layernorm.register_forward_hook(lambda *_: norm_calls.append(1))
        for layer in layers
    ]
    pre = gguf_kernels.layer_pre
    monkeypatch.setattr(
        gguf_kernels, "layer_pre", lambda *a, **kw: glue_calls.append(1) or pre(*a, **kw)
    )

    def prefill_and_step() -> tuple[torch.Tensor, torch.Tensor]:
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            first = model(torch.tensor([PROMPTS[2]]), cache=cache, use_cache=True).logits
            step = model(torch.tensor([[7, 8, 9]]), cache=cache, use_cache=True).logits
        return first, step

    def set_glued(on: bool) -> None:
        for layer in layers:
            layer.lean.glued = on

    try:
        glued = prefill_and_step()
        assert len(glue_calls) == 2 * len(layers) and not norm_calls
        set_glued(False)
        lean = prefill_and_step()
        assert not norm_calls and len(glue_calls) == 2 * len(layers)  # the lean path ran
        assert lean_layers.undo(model) == len(layers)
        modules = prefill_and_step()
        assert len(norm_calls) == 2 * len(layers)
    finally:
        lean_layers.use_for(model)
        for hook in hooks:
            hook.remove()
    assert all(layer.lean.glued for layer in layers)  # a fresh LeanLayer glues again
    assert torch.equal(lean[0], modules[0]) and torch.equal(lean[1], modules[1])
    for got, want in zip(glued, modules, strict=True):
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def requests(sampling: list[SamplingParams], n: int = 20) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", PROMPTS[i % len(PROMPTS)], n, sp)
        for i, sp in enumerate(sampling)
    ]


@pytest.mark.parametrize("k", [1, 3, None])
def test_greedy_speculation_equals_the_served_target_in_bf16(served, k):
    target, draft = served
    reqs = requests([SamplingParams()] * 4)
    want = target_only(target, reqs)
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=k)
    assert dec.target_form.quantization == "gguf"  # the caller's form is kept
    assert [r.output_ids for r in dec.generate_batch(reqs)] == want
    # the draft did propose and was verified (adaptive k may rightly stop drafting
    # on a weak tiny draft, so only a fixed k is sure to accept something)
    assert dec.stats.drafted > 0 and (k is None or dec.stats.accepted > 0)


def test_seeded_sampling_is_the_same_text_alone_and_in_a_busy_batch(served):
    target, draft = served
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.5, num_draft_tokens=3)
    alone = dec.generate_batch(requests([sp]))[0].output_ids
    again = dec.generate_batch(requests([sp]))[0].output_ids
    busy = [SamplingParams(temperature=1.2, seed=s) for s in (1, 2)] + [SamplingParams(), sp]
    in_batch = dec.generate_batch(requests(busy))[3].output_ids
    want = target_only(target, requests([sp]))[0]
    # request r3 of the busy batch has prompt PROMPTS[3]; compare like with like
    busy_alone = dec.generate_batch([GenerationRequest("x", PROMPTS[3], 20, sp)])[0].output_ids
    assert alone == again == want
    assert (
        in_batch
        == busy_alone
        == target_only(target, [GenerationRequest("x", PROMPTS[3], 20, sp)])[0]
    )


def test_auto_serves_the_gguf_and_falls_back_to_dense_saying_why(gguf_dir, tmp_path, caplog):
    model = load(gguf_dir)
    assert target_form.apply(model, "auto", gguf_dir).quantization == "gguf"
    # a directory without its GGUF: dense, quietly (nothing else was there to serve)
    dense = load(gguf_dir)
    assert target_form.apply(dense, "auto", tmp_path).quantization == "none"
    with pytest.raises(ValueError, match=r"no single \.gguf"):
        target_form.apply(load(gguf_dir), "gguf", tmp_path)
    # kernels unavailable: auto serves dense and says why; an explicit gguf is refused
    gguf_kernels._loaded["lib"], saved = None, gguf_kernels._loaded.get("lib")
    try:
        with caplog.at_level(logging.WARNING, logger=target_form.__name__):
            form = target_form.apply(load(gguf_dir), "auto", gguf_dir)
        assert form.quantization == "none" and "could not be built" in form.detail
        assert "target served dense although" in caplog.text
        with pytest.raises(ValueError, match="cannot be served"):
            target_form.apply(load(gguf_dir), "gguf", gguf_dir)
    finally:
        gguf_kernels._loaded["lib"] = saved


def test_a_gguf_of_other_weights_is_refused_before_anything_is_replaced(gguf_dir, tmp_path):
    other = write_tiny_gguf_model(tmp_path / "other", "qwen2", seed=9)
    model = load(gguf_dir)
    (tmp_path / "mixed").mkdir()
    for f in gguf_dir.iterdir():
        (tmp_path / "mixed" / f.name).symlink_to(f)
    (tmp_path / "mixed" / "tiny.gguf").unlink()
    (tmp_path / "mixed" / "tiny.gguf").symlink_to(other / "tiny.gguf")
    with pytest.raises(ValueError, match=r"differ from the loaded weights|no tensor"):
        target_form.apply(model, "gguf", tmp_path / "mixed")
    assert not any(isinstance(m, gguf_kernels.GGUFLinear) for m in model.modules())


def test_int8_serves_q8_0_blocks_made_from_the_dense_weights(gguf_dir):
    reference = load(gguf_dir, torch.float32)
    model = load(gguf_dir, torch.float32)
    form = target_form.apply(model, "int8", None)
    # the 15 linear layers; the embeddings stay dense
    assert form.quantization == "int8" and "Q8_0 x15" in form.detail
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="auto, gguf, int8, none"):
        target_form.check_setting("int4")
    assert target_form.check_setting(" GGUF ") == "gguf"
