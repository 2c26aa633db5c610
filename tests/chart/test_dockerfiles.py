"""The two Dockerfiles: pinned, non-root, health-checked, and their install steps
are the ones the project's tests run.

The images themselves are built for real by the test bed (scripts/testbed/images.sh,
on a Debian base made with debootstrap, since no registry is reachable here) and run
in tests/e2e. These checks are quick and need no Docker: the shape of both files, the
operator image's build stage replayed step by step outside Docker (its COPY, WORKDIR
and RUN instructions, with /opt/venv and /src mapped to a temp dir), and the engine
lock being what the project venv, which the engine tests run against, has installed.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from slimspec_testbed.tools import cache_dir, run_checked

from .conftest import REPO

DIGEST_REF = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")


@dataclass
class Instruction:
    op: str
    args: str


def parse(path: Path) -> list[Instruction]:
    """Dockerfile instructions (comments dropped, continuations joined)."""
    out: list[Instruction] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, args = buf.partition(" ")
        out.append(Instruction(op.upper(), " ".join(args.split())))
        buf = ""
    return out


def stages(instrs: list[Instruction]) -> dict[str, list[Instruction]]:
    """Instructions by stage name; those before the first FROM (global ARGs) under ""."""
    result: dict[str, list[Instruction]] = {"": []}
    name = ""
    for ins in instrs:
        if ins.op == "FROM":
            name = ins.args.split()[-1]
            result[name] = []
        result[name].append(ins)
    return result


@pytest.mark.parametrize(
    ("dockerfile", "component"),
    [("Dockerfile.engine", "engine"), ("Dockerfile.operator", "operator")],
)
def test_dockerfile_shape(dockerfile: str, component: str) -> None:
    instrs = parse(REPO / dockerfile)
    st = stages(instrs)
    glob = st.pop("")
    assert list(st) == ["build", "runtime"], "multi-stage: build, then a clean runtime"
    # One base for both stages, overridable (the test bed builds on its own Debian
    # base); its default is pinned by tag and digest.
    (arg,) = [i.args for i in glob if i.op == "ARG"]
    name, _, default = arg.partition("=")
    assert name == "BASE_IMAGE" and DIGEST_REF.match(default), arg
    for stage in st.values():
        assert stage[0].args.split()[0] == "${BASE_IMAGE}", stage[0]
    runs = [i.args for i in st["build"] if i.op == "RUN"]
    # Exactly the install steps the tests and scripts use: lock first, package
    # second, both without dependency resolution.
    lock = f"pip install --no-deps -r {component}/requirements.lock"
    assert any(r.startswith(lock) for r in runs), runs
    package = re.compile(rf"^pip install --no-deps (--target \S+ )?\./{component} ")
    assert any(package.match(r) for r in runs), runs
    runtime = st["runtime"]
    users = [i.args for i in runtime if i.op == "USER"]
    assert users == ["10001:10001"]
    assert any(i.op == "RUN" and "useradd --system --uid 10001" in i.args for i in runtime)
    (health,) = [i.args for i in runtime if i.op == "HEALTHCHECK"]
    assert "/healthz" in health
    assert any(i.op == "COPY" and i.args.startswith("--from=build /opt/venv") for i in runtime)
    # No secrets and no model weights in the image.
    for ins in instrs:
        if ins.op in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"(TOKEN|PASSWORD|SECRET|API_KEY)\s*=", ins.args, re.I), ins
        if ins.op in ("COPY", "ADD"):
            assert not re.search(r"\.(safetensors|gguf|bin|pt)\b|models/", ins.args), ins
            assert ins.op != "ADD", "COPY only"


def test_engine_image_is_gpu_ready_without_weights() -> None:
    text = (REPO / "Dockerfile.engine").read_text()
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in text
    assert "SLIMSPEC_CACHE=/var/cache/slimspec" in text
    assert 'ENTRYPOINT ["slimspec"]' in text
    assert "EXPOSE 8080" in text
    lock = (REPO / "engine" / "requirements.lock").read_text()
    # The locked torch wheel carries the CUDA runtime (no CUDA base image needed).
    assert re.search(r"^torch==", lock, re.M)
    assert re.search(r"^nvidia-cuda-runtime", lock, re.M)


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    rules = [x for x in lines if x and not x.startswith("#")]
    assert rules[0] == "**"
    assert "!engine" in lines and "!operator" in lines
    assert "**/*.safetensors" in lines and "**/*.gguf" in lines


def locked(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_engine_lock_is_what_the_engine_tests_run_on() -> None:
    pins = locked(REPO / "engine" / "requirements.lock")
    assert "torch" in pins and "transformers" in pins
    mismatched = {}
    for name, version in pins.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            mismatched[name] = (version, have)
    assert not mismatched, f"engine/requirements.lock vs project venv: {mismatched}"


def test_operator_image_build_stage_replayed(tmp_path: Path) -> None:
    """COPY/WORKDIR/RUN of Dockerfile.operator's build stage, run for real."""
    build = stages(parse(REPO / "Dockerfile.operator"))["build"]
    root = tmp_path / "image"
    venv = root / "opt" / "venv"
    workdir = root
    root.mkdir()
    # `python` before the venv exists: a CPython 3.11 like the base image's.
    pre = tmp_path / "pre-bin"
    pre.mkdir()
    base_python = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    )
    assert sys.version_info[:2] == (3, 11)
    (pre / "python").symlink_to(base_python)
    (pre / "python3").symlink_to(base_python)
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = f"{venv / 'bin'}:{pre}:/usr/bin:/bin"
    # Speed only: reuse a download cache (the image build runs with no cache).
    env["PIP_CACHE_DIR"] = str(cache_dir() / "pip")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def mapped(text: str) -> str:
        return text.replace("/opt/venv", str(venv))

    ran = []
    for ins in build[1:]:
        if ins.op == "WORKDIR":
            workdir = root / ins.args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif ins.op == "COPY":
            src, dst = shlex.split(ins.args)
            target = workdir / dst
            if (REPO / src).is_dir():
                shutil.copytree(
                    REPO / src,
                    target,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
                )
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / src, target)
        elif ins.op == "RUN":
            run_checked(["bash", "-ec", mapped(ins.args)], env=env, cwd=workdir, timeout=400)
            ran.append(ins.args)
    assert any("requirements.lock" in r for r in ran)
    # The runtime stage's entry point exists and starts.
    entry = venv / "bin" / "slimspec-operator"
    assert entry.exists()
    out = run_checked([entry, "--help"], env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # Small image: no torch in the operator.
    site = next(iter((venv / "lib").glob("python3.*/site-packages")))
    assert not (site / "torch").exists()


def test_versions_agree() -> None:
    """Chart appVersion = image version labels = the packages' versions."""
    import tomllib

    import yaml

    app = yaml.safe_load((REPO / "charts" / "slimspec" / "Chart.yaml").read_text())["appVersion"]
    for component, dockerfile in (
        ("engine", "Dockerfile.engine"),
        ("operator", "Dockerfile.operator"),
    ):
        meta = tomllib.loads((REPO / component / "pyproject.toml").read_text())["project"]
        assert meta["version"] == app, component
        assert f'org.opencontainers.image.version="{app}"' in (REPO / dockerfile).read_text()
