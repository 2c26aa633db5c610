"""`slimspec` CLI: env vars per docs/contracts.md, flags win, admin token file wins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from slimspec.cli import DEFAULT_DRAFT, DEFAULT_TARGET, build_config, read_admin_token, serve_parser


def test_defaults_serve_the_real_pair_on_8080() -> None:
    args = serve_parser({}).parse_args([])
    assert (args.target, args.draft, args.port) == (DEFAULT_TARGET, DEFAULT_DRAFT, 8080)
    cfg = build_config(args, {})
    assert cfg.model.version == "unversioned" and cfg.settings.compression_ratio == 0.3
    assert cfg.admin_token is None and cfg.runtime_configmap is None
    assert cfg.scheduler.max_batch_size == 8


def test_env_then_flags() -> None:
    env = {
        "MODEL_PATH": "/models/t",
        "DRAFT_MODEL_PATH": "/models/d",
        "COMPRESSION_RATIO": "0.5",
        "MODEL_VERSION": "v7",
        "QUALITY_THRESHOLD": "0.9",
        "FALLBACK_STRATEGY": "none",
        "SLIMSPEC_DTYPE": "float32",
        "SLIMSPEC_DEVICE": "cpu",
        "SLIMSPEC_MAX_BATCH_SIZE": "16",
        "SLIMSPEC_RUNTIME_CONFIGMAP": "svc-runtime",
        "POD_NAMESPACE": "prod",
        "PORT": "9000",
    }
    cfg = build_config(serve_parser(env).parse_args([]), env)
    assert cfg.model.target == "/models/t" and cfg.model.draft == "/models/d"
    assert cfg.model.version == "v7" and cfg.model.dtype == "float32"
    assert cfg.settings.compression_ratio == 0.5 and cfg.settings.fallback_strategy == "none"
    assert cfg.scheduler.max_batch_size == 16
    assert (cfg.runtime_configmap, cfg.namespace) == ("svc-runtime", "prod")
    args = serve_parser(env).parse_args(["--compression-ratio", "0.1", "--port", "1234"])
    assert build_config(args, env).settings.compression_ratio == 0.1 and args.port == 1234


def test_invalid_values_are_refused() -> None:
    # from the environment (i.e. the runtime ConfigMap): warn and use the default
    env = {"COMPRESSION_RATIO": "0.99", "QUALITY_THRESHOLD": "x", "FALLBACK_STRATEGY": "maybe"}
    cfg = build_config(serve_parser(env).parse_args([]), env)
    assert cfg.settings.compression_ratio == 0.3 and cfg.settings.quality_threshold == 0.95
    assert cfg.settings.fallback_strategy == "auto"
    # as an explicit flag: refused
    with pytest.raises(ValueError):
        build_config(serve_parser({}).parse_args(["--compression-ratio", "0.99"]), {})
    with pytest.raises(ValueError):
        build_config(serve_parser({}).parse_args(["--max-batch-size", "300"]), {})


def test_draft_quantization_from_env_and_flag() -> None:
    assert build_config(serve_parser({}).parse_args([]), {}).model.draft_quantization == "auto"
    env = {"SLIMSPEC_DRAFT_QUANTIZATION": "int8-fused"}
    cfg = build_config(serve_parser(env).parse_args([]), env)
    assert cfg.model.draft_quantization == "int8-fused"
    args = serve_parser(env).parse_args(["--draft-quantization", "none"])
    assert build_config(args, env).model.draft_quantization is None
    args = serve_parser({}).parse_args(["--draft-quantization", "auto"])
    assert build_config(args, {}).model.draft_quantization == "auto"
    with pytest.raises(ValueError, match="draft-quantization"):
        build_config(serve_parser({}).parse_args(["--draft-quantization", "fp4"]), {})


def test_num_draft_tokens_fixed_or_adaptive() -> None:
    assert build_config(serve_parser({}).parse_args([]), {}).model.num_draft_tokens is None
    env = {"SLIMSPEC_NUM_DRAFT_TOKENS": "4"}
    assert build_config(serve_parser(env).parse_args([]), env).model.num_draft_tokens == 4
    with pytest.raises(ValueError, match="num-draft-tokens"):
        build_config(serve_parser({}).parse_args(["--num-draft-tokens", "40"]), {})


def test_admin_token_sources(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert read_admin_token({"SLIMSPEC_ADMIN_TOKEN": "env"}) == "env"
    env = {"SLIMSPEC_ADMIN_TOKEN": "env", "SLIMSPEC_ADMIN_TOKEN_FILE": str(f)}
    assert read_admin_token(env) == "from-file"
    assert read_admin_token({"SLIMSPEC_ADMIN_TOKEN": "  "}) is None


def test_console_entry_points() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "slimspec", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "serve" in out.stdout
    out = subprocess.run([sys.executable, "-m", "slimspec", "nope"], capture_output=True, text=True)
    assert out.returncode == 2
    out = subprocess.run(
        [sys.executable, "-m", "slimspec", "serve", "--compression-ratio", "2"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "compression_ratio" in out.stderr


def test_fetch_and_calibrate_delegate() -> None:
    for cmd, needle in (("fetch", "--pair"), ("calibrate", "--draft")):
        out = subprocess.run(
            [sys.executable, "-m", "slimspec", cmd, "--help"], capture_output=True, text=True
        )
        assert out.returncode == 0 and needle in out.stdout, out.stderr


def test_operator_command_line_parses() -> None:
    """docs/contracts.md: the args the operator gives the engine container."""
    argv = ["--host", "0.0.0.0", "--port", "8080", "--max-queue", "32", "--batch-wait-ms", "5"]
    cfg = build_config(serve_parser({}).parse_args(argv), {})
    assert cfg.scheduler.max_queue == 32 and cfg.scheduler.batch_wait_s == 0.005


def test_target_quantization_from_env_and_flag() -> None:
    assert build_config(serve_parser({}).parse_args([]), {}).model.target_quantization == "auto"
    env = {"SLIMSPEC_TARGET_QUANTIZATION": "gguf"}
    assert build_config(serve_parser(env).parse_args([]), env).model.target_quantization == "gguf"
    args = serve_parser(env).parse_args(["--target-quantization", "NONE"])
    assert build_config(args, env).model.target_quantization == "none"
    with pytest.raises(ValueError, match="auto, gguf, int8, none"):
        build_config(serve_parser({}).parse_args(["--target-quantization", "int4"]), {})


def test_lookup_tokens_from_env_and_flag() -> None:
    from slimspec.cli import lookup_tokens
    from slimspec.decoding.lookup import DEFAULT_LOOKUP_TOKENS

    assert serve_parser({}).parse_args([]).lookup_tokens is None
    assert lookup_tokens(None, {}) == DEFAULT_LOOKUP_TOKENS
    assert lookup_tokens(None, {"SLIMSPEC_LOOKUP_TOKENS": "6"}) == 6
    args = serve_parser({}).parse_args(["--lookup-tokens", "0"])  # off
    assert lookup_tokens(args.lookup_tokens, {"SLIMSPEC_LOOKUP_TOKENS": "6"}) == 0
    for bad_flag, bad_env in ((-1, {}), (None, {"SLIMSPEC_LOOKUP_TOKENS": "many"})):
        with pytest.raises(ValueError, match="--lookup-tokens"):
            lookup_tokens(bad_flag, bad_env)


def test_draft_context_from_env_and_flag() -> None:
    from slimspec.cli import draft_context
    from slimspec.decoding.draft_context import DEFAULT_DRAFT_CONTEXT

    assert serve_parser({}).parse_args([]).draft_context is None
    assert draft_context(None, {}) == DEFAULT_DRAFT_CONTEXT
    assert draft_context(None, {"SLIMSPEC_DRAFT_CONTEXT": "128"}) == 128
    args = serve_parser({}).parse_args(["--draft-context", "0"])  # whole prompts
    assert draft_context(args.draft_context, {"SLIMSPEC_DRAFT_CONTEXT": "128"}) == 0
    for bad_flag, bad_env in ((-1, {}), (None, {"SLIMSPEC_DRAFT_CONTEXT": "all"})):
        with pytest.raises(ValueError, match="--draft-context"):
            draft_context(bad_flag, bad_env)


def test_prefix_cache_size_from_env_and_flag() -> None:
    from slimspec.cli import prefix_cache_mb
    from slimspec.decoding.prefix_cache import DEFAULT_MB

    assert serve_parser({}).parse_args([]).prefix_cache_mb is None
    assert prefix_cache_mb(None, {}) == DEFAULT_MB
    assert prefix_cache_mb(None, {"SLIMSPEC_PREFIX_CACHE_MB": "64"}) == 64
    args = serve_parser({}).parse_args(["--prefix-cache-mb", "0"])
    assert prefix_cache_mb(args.prefix_cache_mb, {"SLIMSPEC_PREFIX_CACHE_MB": "64"}) == 0
    with pytest.raises(ValueError, match="--prefix-cache-mb"):
        prefix_cache_mb(-1, {})
