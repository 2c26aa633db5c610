"""Old import path of slimspec.weights.registry, kept only for code outside the engine
package that still imports it (the test bed); new code imports slimspec.weights.registry."""

from slimspec.weights.registry import (
    DEFAULT_DRAFT,
    DEFAULT_PAIR,
    DEFAULT_TARGET,
    MODELS,
    PAIRS,
    SMOLLM2_135M,
    ChunkSource,
    ModelPair,
    ModelSpec,
    get_pair,
    get_spec,
    is_registry_name,
)

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_PAIR",
    "DEFAULT_TARGET",
    "MODELS",
    "PAIRS",
    "SMOLLM2_135M",
    "ChunkSource",
    "ModelPair",
    "ModelSpec",
    "get_pair",
    "get_spec",
    "is_registry_name",
]
