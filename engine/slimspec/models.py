"""Old import path of slimspec.weights.loading, kept only for code outside the engine
package that still imports it (the test bed); new code imports slimspec.weights.loading."""

from slimspec.weights.loading import (
    ModelNotFoundError,
    check_tokenizers_compatible,
    load_causal_lm,
    model_vocab_size,
    resolve_device,
    resolve_model_path,
    torch_dtype,
)

__all__ = [
    "ModelNotFoundError",
    "check_tokenizers_compatible",
    "load_causal_lm",
    "model_vocab_size",
    "resolve_device",
    "resolve_model_path",
    "torch_dtype",
]
