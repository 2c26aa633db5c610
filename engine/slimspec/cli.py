"""`slimspec` command line: serve, fetch, calibrate.

Flags win over environment variables (docs/contracts.md), which win over defaults.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slimspec.weights.registry import DEFAULT_DRAFT, DEFAULT_TARGET

__all__ = ["DEFAULT_DRAFT", "DEFAULT_TARGET", "main", "serve"]


def read_admin_token(env: Mapping[str, str]) -> str | None:
    """SLIMSPEC_ADMIN_TOKEN_FILE wins over SLIMSPEC_ADMIN_TOKEN; blank means none."""
    path = env.get("SLIMSPEC_ADMIN_TOKEN_FILE")
    if path:
        token = Path(path).read_text(encoding="utf-8").strip()
        return token or None
    token = env.get("SLIMSPEC_ADMIN_TOKEN", "").strip()
    return token or None


def read_api_key(env: Mapping[str, str], path: str | None = None) -> str | None:
    """The inference routes' API key: --api-key-file, else SLIMSPEC_API_KEY_FILE (a mounted
    Secret), else SLIMSPEC_API_KEY; blank means no key. Never logged."""
    path = path or env.get("SLIMSPEC_API_KEY_FILE")
    if path:
        key = Path(path).read_text(encoding="utf-8").strip()
        return key or None
    key = env.get("SLIMSPEC_API_KEY", "").strip()
    return key or None


def env_setting(env: Mapping[str, str], var: str, key: str, default: Any) -> Any:
    """A runtime setting from the environment; an invalid value warns and falls back.

    These variables come from the runtime ConfigMap in Kubernetes, where a bad value
    must not crash-loop the pod (the watcher ignores bad values the same way).
    """
    from slimspec.server.runtime_config import validate_setting

    raw = env.get(var)
    if raw is None or not raw.strip():
        return default
    try:
        return validate_setting(key, raw)
    except ValueError as exc:
        logging.getLogger("slimspec.cli").warning("ignoring %s: %s; using %s", var, exc, default)
        return default


def serve_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    e = env.get
    p = argparse.ArgumentParser(prog="slimspec serve", description="Serve a model over HTTP.")
    p.add_argument(
        "--target",
        default=e("MODEL_PATH", DEFAULT_TARGET),
        help="target model: registry name, HF directory or hub id (env MODEL_PATH)",
    )
    p.add_argument(
        "--draft",
        default=e("DRAFT_MODEL_PATH", DEFAULT_DRAFT),
        help="draft model, or 'none' for target-only decoding (env DRAFT_MODEL_PATH)",
    )
    p.add_argument("--model-version", default=e("MODEL_VERSION", "unversioned"))
    p.add_argument(
        "--served-model-name",
        default=e("SLIMSPEC_SERVED_MODEL_NAME"),
        help="model id in /v1/models and responses (env SLIMSPEC_SERVED_MODEL_NAME; default: "
        "the target's registry name, or its directory's name)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="require 'Authorization: Bearer <key>' on the inference routes, key read from "
        "this file (env SLIMSPEC_API_KEY_FILE, or the key itself in SLIMSPEC_API_KEY)",
    )
    p.add_argument(
        "--dtype",
        default=e("SLIMSPEC_DTYPE", "bfloat16"),
        choices=["float32", "bfloat16", "float16"],
    )
    p.add_argument("--device", default=e("SLIMSPEC_DEVICE", "auto"))
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=int(e("SLIMSPEC_NUM_DRAFT_TOKENS", "0")),
        help="fixed number of draft tokens per step, 1-16; 0 = adaptive (env "
        "SLIMSPEC_NUM_DRAFT_TOKENS)",
    )
    p.add_argument(
        "--draft-quantization",
        default=e("SLIMSPEC_DRAFT_QUANTIZATION", "auto"),
        help="draft weights: auto | none | int8 | int8-fused | int4-fused | bf16-fused (a "
        "speed option, separate from compression_ratio; output stays exact; auto, the "
        "default = int4-fused on CPU for bf16/fp16 Llama/Qwen2 drafts, else none) "
        "(env SLIMSPEC_DRAFT_QUANTIZATION)",
    )
    p.add_argument(
        "--target-quantization",
        default=e("SLIMSPEC_TARGET_QUANTIZATION", "auto"),
        help="target weights: auto | gguf | int8 | none. gguf = the blocks of the GGUF the "
        "model directory was converted from (Q4_K, Q6_K, Q8_0), int8 = Q8_0 blocks made from "
        "dense weights, none = dense as loaded; auto, the default = gguf where the model "
        "directory holds its GGUF and the device is the CPU, else none (env "
        "SLIMSPEC_TARGET_QUANTIZATION)",
    )
    p.add_argument("--host", default=e("HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(e("PORT", "8080")))
    p.add_argument(
        "--compression-ratio",
        type=float,
        default=env_setting(env, "COMPRESSION_RATIO", "compression_ratio", 0.3),
    )
    p.add_argument(
        "--quality-threshold",
        type=float,
        default=env_setting(env, "QUALITY_THRESHOLD", "quality_threshold", 0.95),
    )
    p.add_argument(
        "--fallback-strategy",
        default=env_setting(env, "FALLBACK_STRATEGY", "fallback_strategy", "auto"),
        choices=["auto", "none"],
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=int(e("SLIMSPEC_MAX_BATCH_SIZE", "8")),
        help="1..256; 1 = no batching",
    )
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting for a batch slot before 429"
    )
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument(
        "--max-new-tokens", type=int, default=1024, help="upper limit of max_length / max_tokens"
    )
    p.add_argument("--max-input-tokens", type=int, default=8192)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=float(e("SLIMSPEC_REQUEST_TIMEOUT", "300")),
        help="seconds per request (env SLIMSPEC_REQUEST_TIMEOUT); the operator sizes the pod's "
        "termination grace period from it",
    )
    p.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds to receive request headers"
    )
    p.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds to receive a request body"
    )
    p.add_argument(
        "--max-connection-age",
        type=float,
        default=10.0,
        help="seconds after which a kept-alive connection is closed after its next answer, "
        "so clients reconnect through the Service and reach new replicas (0: never)",
    )
    p.add_argument(
        "--load-attempts",
        type=int,
        default=4,
        help="model load attempts (back-off between them) before liveness fails",
    )
    p.add_argument(
        "--step-watchdog",
        type=float,
        default=300.0,
        help="seconds an engine step may run before liveness fails",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        help="most prompt tokens prefilled per engine step (long prompts are prefilled in "
        "chunks between decode steps of the other requests)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=None,
        help="MiB of the prefix cache, which keeps both models' keys and values of earlier "
        "prompts so a prompt that starts like one of them skips that part's prefill; 0 = "
        "off (env SLIMSPEC_PREFIX_CACHE_MB; default 256)",
    )
    p.add_argument(
        "--lookup-tokens",
        type=int,
        default=None,
        help="most tokens a lookup draft proposes: where a request's last tokens occurred "
        "earlier in its prompt or output, what followed them then is verified instead of "
        "the draft model's tokens on the steps where that pays; 0 = off (env "
        "SLIMSPEC_LOOKUP_TOKENS; default 12). Output stays the same",
    )
    p.add_argument(
        "--draft-context",
        type=int,
        default=None,
        help="most prompt tokens the draft model prefills: the last ones before the "
        "prompt's final token (the target always reads the whole prompt); 0 = the whole "
        "prompt (env SLIMSPEC_DRAFT_CONTEXT; default 64). Output stays the same",
    )
    p.add_argument(
        "--blocked-words",
        default=e("SLIMSPEC_BLOCKED_WORDS", ""),
        help="comma-separated words replaced by *** in outputs",
    )
    p.add_argument("--runtime-configmap", default=e("SLIMSPEC_RUNTIME_CONFIGMAP"))
    p.add_argument("--namespace", default=e("POD_NAMESPACE"))
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--log-level", default=e("SLIMSPEC_LOG_LEVEL", "info"))
    return p


def _in_cluster_namespace() -> str | None:
    f = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return f.read_text().strip() if f.exists() else None


def draft_quantization(value: str) -> str | None:
    """'none' (or empty) -> None; 'auto' or one of slimspec.cpu.draft_quantization.QUANTIZATIONS."""
    from slimspec.cpu.draft_quantization import AUTO, QUANTIZATIONS

    mode = value.strip().lower()
    if mode in ("", "none"):
        return None
    if mode != AUTO and mode not in QUANTIZATIONS:
        raise ValueError(
            f"--draft-quantization must be none, {AUTO} or one of {', '.join(QUANTIZATIONS)}, "
            f"got {value!r}"
        )
    return mode


def target_quantization(value: str) -> str:
    """One of slimspec.cpu.target_form.TARGET_QUANTIZATIONS (ValueError naming them)."""
    from slimspec.cpu.target_form import check_setting

    return check_setting(value)


def num_draft_tokens(value: int) -> int | None:
    """0 -> None (adaptive k); 1..16 -> a fixed k."""
    if value == 0:
        return None
    if not 1 <= value <= 16:
        raise ValueError(f"--num-draft-tokens must be 0 (adaptive) or 1-16, got {value}")
    return value


def prefix_cache_mb(value: float | None, env: Mapping[str, str]) -> float:
    """--prefix-cache-mb, else SLIMSPEC_PREFIX_CACHE_MB, else the default (MiB, >= 0)."""
    from slimspec.decoding.prefix_cache import resolve_mb

    try:
        return resolve_mb(value, env)
    except ValueError as exc:
        raise ValueError(f"--prefix-cache-mb: {exc}") from None


def lookup_tokens(value: int | None, env: Mapping[str, str]) -> int:
    """--lookup-tokens, else SLIMSPEC_LOOKUP_TOKENS, else the default (>= 0; 0 = off)."""
    from slimspec.decoding.lookup import resolve_lookup_tokens

    try:
        return resolve_lookup_tokens(value, env)
    except ValueError as exc:
        raise ValueError(f"--lookup-tokens: {exc}") from None


def draft_context(value: int | None, env: Mapping[str, str]) -> int:
    """--draft-context, else SLIMSPEC_DRAFT_CONTEXT, else the default (>= 0; 0 = all)."""
    from slimspec.decoding.draft_context import resolve_draft_context

    try:
        return resolve_draft_context(value, env)
    except ValueError as exc:
        raise ValueError(f"--draft-context: {exc}") from None


def positive(flag: str, value: float) -> Any:
    if not value > 0:
        raise ValueError(f"{flag} must be > 0, got {value}")
    return value


def not_negative(flag: str, value: float) -> float:
    if not value >= 0:
        raise ValueError(f"{flag} must be >= 0, got {value}")
    return value


def build_config(args: argparse.Namespace, env: Mapping[str, str]):  # -> ServerConfig
    from slimspec.server.app import ServerConfig
    from slimspec.server.health import HealthPolicy
    from slimspec.server.postprocess import FilterRules, parse_blocked_words
    from slimspec.server.runtime_config import RuntimeSettings, validate_setting
    from slimspec.server.scheduler import SchedulerConfig
    from slimspec.server.service import Limits, ModelRef

    settings = RuntimeSettings(
        compression_ratio=validate_setting("compression_ratio", args.compression_ratio),
        quality_threshold=validate_setting("quality_threshold", args.quality_threshold),
        fallback_strategy=validate_setting("fallback_strategy", args.fallback_strategy),
    )
    return ServerConfig(
        model=ModelRef(
            target=args.target,
            draft=args.draft,
            version=args.model_version,
            dtype=args.dtype,
            device=args.device,
            draft_quantization=draft_quantization(args.draft_quantization),
            target_quantization=target_quantization(args.target_quantization),
            num_draft_tokens=num_draft_tokens(args.num_draft_tokens),
            prefill_chunk=positive("--prefill-chunk", args.prefill_chunk),
        ),
        scheduler=SchedulerConfig(
            max_batch_size=args.max_batch_size,
            max_queue=args.max_queue,
            batch_wait_s=args.batch_wait_ms / 1000,
        ),
        limits=Limits(
            max_new_tokens=args.max_new_tokens,
            max_input_tokens=args.max_input_tokens,
            request_timeout_s=positive("--request-timeout", args.request_timeout),
            header_timeout_s=positive("--header-timeout", args.header_timeout),
            body_timeout_s=positive("--body-timeout", args.body_timeout),
            max_connection_age_s=not_negative("--max-connection-age", args.max_connection_age),
        ),
        health=HealthPolicy(load_attempts=args.load_attempts, step_watchdog_s=args.step_watchdog),
        settings=settings,
        filters=FilterRules(parse_blocked_words(args.blocked_words)),
        admin_token=read_admin_token(env),
        runtime_configmap=args.runtime_configmap or None,
        namespace=args.namespace or _in_cluster_namespace(),
        served_model_name=args.served_model_name or None,
        api_key=read_api_key(env, args.api_key_file),
        warmup=not args.no_warmup,
    )


def serve(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = serve_parser(env)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = build_config(args, env)
        cache_mb = prefix_cache_mb(args.prefix_cache_mb, env)
        lookup = lookup_tokens(args.lookup_tokens, env)
        window = draft_context(args.draft_context, env)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    # The engines read their prefix cache size, lookup drafts' length and the draft's
    # prompt window from the environment (every engine this process loads, hot swaps
    # included, gets the same).
    from slimspec.decoding import draft_context as draft_window
    from slimspec.decoding import lookup as lookup_drafts
    from slimspec.decoding import prefix_cache

    os.environ[prefix_cache.ENV] = f"{cache_mb:g}"
    os.environ[lookup_drafts.ENV] = str(lookup)
    os.environ[draft_window.ENV] = str(window)
    import uvicorn

    from slimspec.server.app import create_app
    from slimspec.server.http import uvicorn_config

    config = uvicorn_config(
        create_app(cfg),
        cfg.limits.header_timeout_s,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        # after SIGTERM, requests still running get as long as a request may take
        timeout_graceful_shutdown=int(cfg.limits.request_timeout_s) + 1,
    )
    uvicorn.Server(config).run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: slimspec {serve,fetch,calibrate} [options]  (-h after a command for help)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        return serve(rest)
    if cmd == "fetch":
        from slimspec import fetch

        return int(fetch.main(rest) or 0)
    if cmd == "calibrate":
        from slimspec import calibrate

        return int(calibrate.main(rest) or 0)
    print(f"unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2
