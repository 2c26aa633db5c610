"""Where the engine keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The project's cache directory: $SLIMSPEC_CACHE, else $XDG_CACHE_HOME/slimspec, else
    ~/.cache/slimspec (the same rule as scripts/lib.sh)."""
    env = os.environ.get("SLIMSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "slimspec"
