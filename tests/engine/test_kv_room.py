"""The batched KV cache's layers grow in place (decoding/kv.py GrowingLayer): what a
forward appends lands behind the cached slots without copying them, and every
operation that replaces a layer's tensors (compaction, row selection, trimming,
padding) still gives the values a concatenating cache would."""

from __future__ import annotations

import torch
from slimspec.decoding.kv import GROW_MIN, BatchKV, GrowingLayer, new_cache
from transformers import DynamicCache

from tests.support.tiny_models import tiny_config


def slots(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


def test_updates_append_in_place_and_equal_concatenation():
    config = tiny_config()
    cache, plain = new_cache(config), DynamicCache(config=config)
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    rooms = set()
    for step, t in enumerate([5, 1, 3, 1, 1]):
        k, v = slots(2, t, step)
        got = cache.update(k, v, 0)
        want = plain.update(k, v, 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        rooms.add(cache.layers[0]._key_room.data_ptr())
    assert len(rooms) == 1  # 11 slots: all in the room the first 5 made
    keys = cache.layers[0].keys
    assert keys.shape == (2, 2, 11, 8) and keys.stride(1) == (5 + GROW_MIN) * 8  # made at 5
    # a replaced tensor (as compaction leaves it) gets fresh room, values kept
    cache.layers[0].keys = keys[:, :, 2:].contiguous()
    cache.layers[0].values = cache.layers[0].values[:, :, 2:].contiguous()
    k, v = slots(2, 2, 9)
    got_k, _ = cache.update(k, v, 0)
    assert torch.equal(got_k, torch.cat([keys[:, :, 2:], k], dim=2))
    assert cache.layers[0]._key_room.data_ptr() not in rooms
    # the room grows past its spare slots
    for i in range(GROW_MIN + 20):
        cache.update(*slots(2, 1, 100 + i), 0)
    assert cache.layers[0].keys.shape[2] == 11 + GROW_MIN + 20


def test_batch_operations_on_grown_layers_give_the_concatenated_values():
    """The same forwards and batch operations on a growing and on a concatenating
    cache leave the same keys, values and validity."""
    config = tiny_config()
    grown, plain = BatchKV("cpu"), BatchKV("cpu")

    def forward(t: int, seed: int, real: torch.Tensor | None = None) -> None:
        k, v = slots(grown.batch_size or 3, t, seed)
        real = torch.ones(k.shape[0], t, dtype=torch.bool) if real is None else real
        for kv, make in ((grown, new_cache), (plain, lambda c: DynamicCache(config=c))):
            kv.mask_for(real, torch.float32)
            cache = kv.cache if kv.cache is not None else make(config)
            for i in range(len(cache.layers)):
                cache.update(k, v, i)
            kv.after_forward(cache, real)

    def same() -> None:
        assert torch.equal(grown.valid, plain.valid)
        for a, b in zip(grown.cache.layers, plain.cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    forward(4, 0)
    forward(3, 1)
    same()
    for kv in (grown, plain):
        kv.invalidate_tail(4, torch.tensor([0, 2, 1]))
    forward(1, 2)
    for kv in (grown, plain):
        kv.compact()
    same()
    forward(2, 3)
    for kv in (grown, plain):
        kv.select_rows([2, 0])
    forward(1, 4)
    same()
    other_g, other_p = BatchKV("cpu"), BatchKV("cpu")
    k, v = slots(1, 6, 5)
    for kv, make in ((other_g, new_cache), (other_p, lambda c: DynamicCache(config=c))):
        kv.mask_for(torch.ones(1, 6, dtype=torch.bool), torch.float32)
        cache = make(config)
        for i in range(len(cache.layers)):
            cache.update(k, v, i)
        kv.after_forward(cache, torch.ones(1, 6, dtype=torch.bool))
    grown.append_rows(other_g)
    plain.append_rows(other_p)
    forward(2, 6)
    same()
