"""Entering the real node's network namespace from this process.

Pod and Service addresses exist only inside the node's network namespace (see
``scripts/testbed/node.sh``). A network namespace is a per-thread attribute, so the
calling thread can switch into it and back: sockets it opens, threads it starts and
subprocesses it spawns while inside belong to the node's network (kubectl, helm,
HTTP clients, a Prometheus server).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


class NetworkNamespace:
    """The network namespace of a process (the node's namespace holder)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.path = Path(f"/proc/{pid}/ns/net")

    @property
    def inode(self) -> int:
        return self.path.stat().st_ino

    def is_current(self) -> bool:
        return Path("/proc/thread-self/ns/net").stat().st_ino == self.inode

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the with-block's body in this namespace (this thread only); re-entrant."""
        if self.is_current():
            yield
            return
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(self.path, os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)
