"""Child processes of the control plane, and polling until something holds."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from slimspec_testbed.errors import TestbedError, fail
from slimspec_testbed.tools import stop_process

T = TypeVar("T")


def _die_with_parent() -> None:
    """Child pre-exec: SIGKILL when the parent dies, so no control plane outlives it.

    Not SIGTERM: kube-apiserver can hang in graceful shutdown once etcd is gone.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10) -> None:
        stop_process(self.proc, timeout)


def spawn(name: str, argv: Sequence[str | os.PathLike[str]], workdir: Path) -> Component:
    """Start a component with its output in ``<workdir>/<name>.log``."""
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,  # only calls prctl
        )
    return Component(name, proc, log_path)


def poll(fn: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Call fn until it returns something truthy; TestbedError after timeout.

    A TestbedError raised by fn (a component died) ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except TestbedError:
            raise
        except Exception as exc:  # keep the last error for the failure message
            last_error = exc
        if time.monotonic() > deadline:
            fail(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")
        time.sleep(interval)
