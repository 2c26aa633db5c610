"""A GGUF file's tensors without parsing its metadata arrays.

Why: gguf's GGUFReader turns every element of every metadata array into numpy views in
Python, one at a time. A Qwen2.5 file carries its tokenizer (151,936 tokens, ~150,000
merges, a token type each) as such arrays, so opening the 1.5B target took ~5 s of a
~8 s `target_form.apply`, for fields the serving never reads (the tokenizer comes from
the model directory). `TensorReader` is GGUFReader with arrays skipped over: their
length and item type are kept (a field's parts [item type, length]), their items not
(`contents()` of such a field is empty); scalars, strings and every tensor are GGUFReader's
own. Anything the subclass cannot handle (another gguf version's internals) falls back
to the plain reader: slower, the same tensors.
"""

from __future__ import annotations

import logging
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

log = logging.getLogger(__name__)

# bytes of one array item of each fixed-size type
_ITEM_BYTES = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}


class TensorReader(GGUFReader):
    """GGUFReader that skips over metadata arrays instead of reading their items."""

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        end = orig_offs + 12 + self._array_bytes(orig_offs + 12, int(item_type[0]), int(length[0]))
        return end - orig_offs, [item_type, length], [], [GGUFValueType.ARRAY]

    def _array_bytes(self, offs: int, item_type: int, length: int) -> int:
        """The size of `length` items of `item_type` stored from offs."""
        kind = GGUFValueType(item_type)
        if kind in _ITEM_BYTES:
            return _ITEM_BYTES[kind] * length
        if kind == GGUFValueType.STRING:  # each a uint64 length, then its bytes
            order = "<" if (sys.byteorder == "little") == (self.byte_order == "I") else ">"
            view, start = self.data.data, offs  # the memmap's buffer
            read = struct.Struct(order + "Q").unpack_from
            for _ in range(length):
                offs += 8 + read(view, offs)[0]
            return offs - start
        if kind == GGUFValueType.ARRAY:  # nested arrays: each its own item type and length
            start = offs
            for _ in range(length):
                inner, count = (
                    int(self._get(offs, np.uint32)[0]),
                    int(self._get(offs + 4, np.uint64)[0]),
                )
                offs += 12 + self._array_bytes(offs + 12, inner, count)
            return offs - start
        raise ValueError(f"unknown GGUF array item type {item_type}")


def open_tensors(path: Path) -> GGUFReader:
    """A reader of path's tensors and scalar metadata (arrays skipped, see above)."""
    try:
        return TensorReader(path)
    except (AttributeError, TypeError, ValueError, IndexError) as exc:
        log.info("reading %s with gguf's full reader (%s)", path.name, exc)
        return GGUFReader(path)
