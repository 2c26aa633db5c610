"""The engine image's native CPU kernels: compile them at build time, check them in
the built image. Two sources: the fused drafts' kernels (draft_kernels, one build with
AVX512-VNNI and one with AVX2) and the GGUF block kernels the target is served from
(gguf_kernels: AMX, AVX512-VNNI, AVX-VNNI, AVX2 and portable builds), since the image may
run on any x86-64 CPU.

    python native_kernels.py build DIR   # build stage (has the C compiler)
    python native_kernels.py check DIR   # in the runtime image (has none)

`build` compiles the engine's C source with the engine's own build function and
flags into DIR, under the name the engine looks for there when $SLIMSPEC_KERNELS_DIR
is DIR (keyed by the source and the flags: the image sets it). `check` loads every
library in DIR with ctypes, binds the functions the engine calls, and runs the engine's
self-checks against the float reference on the build this CPU would load (the others
would be illegal instructions here). It prints one JSON line: what it found and ran.

The engine module is looked up by name so that this script survives the module
moving inside the package.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

MODULES = ("slimspec.cpu.native_kernels", "slimspec.native_kernels")
GGUF_MODULE = "slimspec.cpu.gguf_kernels"
COMPILERS = ("cc", "gcc", "clang")


def kernels_module() -> ModuleType:
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"no native kernels module among {MODULES}")


def build(out_dir: Path) -> dict[str, object]:
    mod = kernels_module()
    cc = next((c for c in COMPILERS if shutil.which(c)), None)
    if cc is None:
        raise SystemExit(f"no C compiler among {COMPILERS}: the build stage needs one")
    drafts = []
    for _name, flags, _needs in mod.BUILDS:
        out = out_dir / mod.prebuilt_name(flags)
        mod._build(cc, out, flags)
        drafts.append(str(out))
    gguf = importlib.import_module(GGUF_MODULE)
    from slimspec.cpu import clib

    gguf_out = []
    for _name, flags, _needs, _simd in gguf.BUILDS:
        path = out_dir / clib.prebuilt_name(gguf.SOURCE, flags)
        clib.build(cc, gguf.SOURCE, flags, path)
        gguf_out.append(str(path))
    return {"module": mod.__name__, "compiler": cc, "libraries": drafts, "gguf": gguf_out}


def check(lib_dir: Path) -> dict[str, object]:
    mod = kernels_module()
    libraries = sorted(p for p in lib_dir.glob("*.so") if not p.name.startswith("gguf_"))
    if not libraries:
        raise SystemExit(f"no compiled kernels in {lib_dir}")
    cpu_ok = bool(mod.cpu_supported())
    mine = mod.prebuilt_name() if cpu_ok else None
    result: dict[str, object] = {
        "module": mod.__name__,
        "libraries": [p.name for p in libraries],
        "compilers_on_path": [c for c in COMPILERS if shutil.which(c)],
        "cpu_supported": cpu_ok,
        "for_this_cpu": mine,
        "self_check": None,
    }
    for path in libraries:
        lib = mod._bind(ctypes.CDLL(str(path)))  # dlopen + every symbol the engine binds
        if path.name == mine:  # run only the build whose instructions this CPU has
            bits_ok = all(mod._self_check(lib, b) for b in mod.QUANT_BITS)
            result["self_check"] = bool(bits_ok and mod._attention_self_check(lib))
    result.update(check_gguf(lib_dir))
    return result


def check_gguf(lib_dir: Path) -> dict[str, object]:
    """Bind every GGUF kernel build; run the self-check of the one this CPU would load."""
    from slimspec.cpu import clib

    gguf = importlib.import_module(GGUF_MODULE)
    mine = clib.prebuilt_name(gguf.SOURCE, gguf.cflags())
    found = sorted(lib_dir.glob("gguf_kernels-*.so"))
    checked = None
    for path in found:
        lib = gguf._bind(ctypes.CDLL(str(path)))
        if path.name == mine:
            checked = bool(gguf.self_check(lib))
    return {
        "gguf_libraries": [p.name for p in found],
        "gguf_for_this_cpu": mine,
        "gguf_self_check": checked,
    }


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[1] not in ("build", "check"):
        raise SystemExit(__doc__)
    target = Path(argv[2])
    report = build(target) if argv[1] == "build" else check(target)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv)
