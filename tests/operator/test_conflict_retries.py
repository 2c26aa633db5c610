"""kube.conflict_retries: a read-plan-write round runs again after a 409 from its
conditional write, at most 1 + retries times, and nothing else is retried."""

from __future__ import annotations

import pytest
from slimspec_operator.kube.client import ApiError, conflict_retries


def _round(outcomes: list[int | None]) -> tuple[list[int], list[bool]]:
    """Run rounds whose write answers `outcomes` in turn (None: it lands)."""
    tries: list[int] = []
    retried: list[bool] = []
    for attempt in conflict_retries(retries=2):
        with attempt:
            tries.append(attempt.number)
            retried.append(attempt.retry)
            status = outcomes[attempt.number]
            if status is not None:
                raise ApiError(status, '{"message": "changed"}')
    return tries, retried


def test_a_landed_write_ends_the_rounds() -> None:
    assert _round([None]) == ([0], [False])


def test_a_conflict_plans_again_from_a_fresh_read() -> None:
    assert _round([409, 409, None]) == ([0, 1, 2], [False, True, True])


def test_the_last_conflict_is_raised() -> None:
    with pytest.raises(ApiError) as exc:
        _round([409, 409, 409])
    assert exc.value.status == 409


def test_other_errors_are_not_retried() -> None:
    with pytest.raises(ApiError) as exc:
        _round([500, None])
    assert exc.value.status == 500
