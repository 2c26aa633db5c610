"""SlimSpec engine.

`import slimspec` stays cheap (no torch): the decoder is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slimspec.decoding.decoder import SpeculativeDecoder

__all__ = ["SpeculativeDecoder"]


def __getattr__(name: str) -> Any:
    if name == "SpeculativeDecoder":
        from slimspec.decoding.decoder import SpeculativeDecoder

        return SpeculativeDecoder
    raise AttributeError(f"module 'slimspec' has no attribute {name!r}")
