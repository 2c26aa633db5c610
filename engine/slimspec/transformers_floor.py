"""The oldest transformers the engine runs on, checked before any model is built.

transformers 5.24 renamed the models' `past_key_values` argument to `cache`; the engine
passes `cache=`, which an older release silently takes as an unknown keyword (each
forward would then start an empty cache). Failing at import with the version to install
is kinder than wrong caches deep in a decoding step.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import InvalidVersion, Version

TRANSFORMERS_FLOOR = "5.24"


def transformers_too_old(installed: str, floor: str = TRANSFORMERS_FLOOR) -> bool:
    """True when `installed` predates `floor` (a dev or rc build of the floor counts as it)."""
    try:
        return Version(installed).release < Version(floor).release
    except InvalidVersion:
        return False  # a local build we cannot read: let it run


def require_transformers() -> None:
    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return  # the import that needs it names what is missing
    if transformers_too_old(installed):
        raise ImportError(
            f"slimspec needs transformers>={TRANSFORMERS_FLOOR} (models take `cache=`), "
            f"found {installed}: pip install 'transformers>={TRANSFORMERS_FLOOR}'"
        )
