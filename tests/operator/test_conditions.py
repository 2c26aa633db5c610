from datetime import UTC, datetime

import pytest
from slimspec_operator.kube.conditions import get_condition, is_true, set_condition

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
T1 = datetime(2026, 1, 1, 12, 5, 0, tzinfo=UTC)


def test_new_condition_is_appended_with_transition_time():
    out = set_condition([], "Ready", True, "Ok", "all good", 3, T0)
    assert out == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "Ok",
            "message": "all good",
            "observedGeneration": 3,
            "lastTransitionTime": "2026-01-01T12:00:00Z",
        }
    ]


def test_transition_time_moves_only_when_status_flips():
    first = set_condition(None, "Ready", "False", "Waiting", "0/2", 1, T0)
    same = set_condition(first, "Ready", "False", "Waiting", "1/2", 2, T1)
    assert same[0]["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert same[0]["message"] == "1/2" and same[0]["observedGeneration"] == 2
    flipped = set_condition(same, "Ready", "True", "Ok", "2/2", 2, T1)
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T12:05:00Z"


def test_other_conditions_untouched_and_input_not_mutated():
    base = set_condition([], "Ready", True, "Ok", "", 1, T0)
    base = set_condition(base, "Degraded", False, "Ok", "", 1, T0)
    snapshot = [dict(c) for c in base]
    out = set_condition(base, "Degraded", True, "RolloutFailed", "v2 never ready", 2, T1)
    assert base == snapshot
    assert [c["type"] for c in out] == ["Ready", "Degraded"]
    assert out[0] == base[0]
    assert is_true(out, "Degraded") and not is_true(out, "Progressing")
    assert get_condition(out, "Degraded")["reason"] == "RolloutFailed"


def test_bad_status_rejected():
    with pytest.raises(ValueError):
        set_condition([], "Ready", "yes", "", "", None, T0)
