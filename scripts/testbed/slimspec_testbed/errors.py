"""The one error the test bed raises when a piece of it cannot do its job."""

from __future__ import annotations

from typing import NoReturn


class TestbedError(Exception):
    """A missing binary, a component that died, a wait that timed out.

    ``traceback=False`` marks errors whose message says everything (how to install a
    binary, a component's log): the tests' reporting hook then shows only the message.
    """

    __test__ = False  # not a test class, despite the name

    def __init__(self, message: str, *, traceback: bool = True) -> None:
        super().__init__(message)
        self.traceback = traceback


def fail(message: str, *, traceback: bool = True) -> NoReturn:
    raise TestbedError(message, traceback=traceback)
