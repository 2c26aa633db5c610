"""Opening a GGUF for its tensors (cpu/gguf_file.py): the same tensors and scalar
metadata as gguf's own reader, with the metadata arrays (a tokenizer's 150k tokens)
skipped over instead of parsed; a reader that cannot skip falls back to gguf's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from slimspec.cpu import gguf_file


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    """A file with arrays of every kind before its tensors (strings, numbers, nested)."""
    path = tmp_path_factory.mktemp("gguf") / "arrays.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_string("general.name", "arrays")
    writer.add_uint32("test.count", 7)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "héllo", "x" * 300] * 400)
    writer.add_array("tokenizer.ggml.token_type", list(range(2000)))
    writer.add_array("test.floats", [0.5, 1.5, -2.0])
    writer.add_array("test.nested", [[1, 2, 3], [4], ["s", "tt"]])
    writer.add_string("test.after_arrays", "still read")
    rng = np.random.default_rng(0)
    writer.add_tensor("a.weight", rng.standard_normal((8, 32)).astype(np.float32))
    blocks = rng.integers(0, 256, size=(16, 210), dtype=np.uint8)
    writer.add_tensor("b.weight", blocks, raw_dtype=GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tensors_and_scalars_are_ggufs_own(gguf_path):
    fast, full = gguf_file.open_tensors(gguf_path), GGUFReader(gguf_path)
    assert isinstance(fast, gguf_file.TensorReader)
    assert [t.name for t in fast.tensors] == ["a.weight", "b.weight"]
    for ours, theirs in zip(fast.tensors, full.tensors, strict=True):
        assert ours.name == theirs.name and ours.tensor_type == theirs.tensor_type
        assert ours.data_offset == theirs.data_offset
        assert np.array_equal(ours.shape, theirs.shape)
        assert np.array_equal(np.asarray(ours.data), np.asarray(theirs.data))
    assert list(fast.fields) == list(full.fields)
    for name in ("general.architecture", "general.name", "test.count", "test.after_arrays"):
        assert fast.fields[name].contents() == full.fields[name].contents(), name
    assert fast.fields["test.after_arrays"].contents() == "still read"


def test_arrays_are_skipped_not_parsed(gguf_path):
    fast = gguf_file.open_tensors(gguf_path)
    for name, length in (
        ("tokenizer.ggml.tokens", 2000),
        ("tokenizer.ggml.token_type", 2000),
        ("test.floats", 3),
        ("test.nested", 3),
    ):
        field = fast.fields[name]
        assert field.types == [GGUFValueType.ARRAY], name
        assert int(field.parts[-1][0]) == length, name  # [.., item type, length]


def test_a_reader_that_cannot_skip_falls_back_to_ggufs(gguf_path, monkeypatch):
    def broken(self, offs, raw_type):
        raise TypeError("internals changed")

    monkeypatch.setattr(gguf_file.TensorReader, "_get_field_parts", broken)
    reader = gguf_file.open_tensors(gguf_path)
    assert type(reader) is GGUFReader
    assert [t.name for t in reader.tensors] == ["a.weight", "b.weight"]
