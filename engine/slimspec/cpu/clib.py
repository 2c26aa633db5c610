"""Build a C source of this package once and find ahead-built copies of it.

Shared by the native kernel modules (native_kernels.py, gguf_kernels.py): a source is
compiled with the system C compiler into $SLIMSPEC_CACHE/kernels, keyed by the source
bytes, the compiler and the flags, so an edited source or other flags build anew; a
library built ahead for the very source and flags in $SLIMSPEC_KERNELS_DIR (the engine
image's runtime has no compiler) is used instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from slimspec.paths import cache_root

# Libraries compiled ahead of time (the engine image's build stage), named by prebuilt_name().
PREBUILT_DIR_ENV = "SLIMSPEC_KERNELS_DIR"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (or the given text); empty if unknown."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def compiler() -> str | None:
    """The C compiler to use ($CC, cc, gcc or clang), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _key(source: Path, parts: Sequence[str]) -> str:
    return hashlib.sha256(source.read_bytes() + " ".join(parts).encode()).hexdigest()[:16]


def library_path(source: Path, cc: str, cflags: Sequence[str]) -> Path:
    """Where the build of `source` with this compiler and flags lives in the cache."""
    return cache_root() / "kernels" / f"{source.stem}-{_key(source, (cc, *cflags))}.so"


def prebuilt_name(source: Path, cflags: Sequence[str]) -> str:
    """The file name of an ahead-of-time build of `source` with `cflags`: a library
    built from another source (another weight layout) never matches."""
    return f"{source.stem}-src-{_key(source, tuple(cflags))}.so"


def prebuilt(source: Path, cflags: Sequence[str]) -> Path | None:
    """The ahead-built library for this source and flags in $SLIMSPEC_KERNELS_DIR, if any."""
    folder = os.environ.get(PREBUILT_DIR_ENV)
    path = Path(folder) / prebuilt_name(source, cflags) if folder else None
    return path if path is not None and path.is_file() else None


def build(cc: str, source: Path, cflags: Sequence[str], out: Path) -> None:
    """Compile `source` into the shared library `out` (atomically: a concurrent builder
    never loads a partial file). Raises subprocess.CalledProcessError with the
    compiler's output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        cmd = [cc, *cflags, "-shared", "-fPIC", str(source), "-o", str(tmp_so), "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp_so, out)
