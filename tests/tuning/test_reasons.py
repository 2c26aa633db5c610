"""The tuner's words are enums whose values are the text status and Events carry:
each spelled once, written as plain strings, read back equal."""

from __future__ import annotations

import json

from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.status import effect_from_status
from slimspec_operator.tuning.trials import Basis, Outcome


def test_the_words_status_carries_are_unchanged() -> None:
    # Status written by earlier versions holds these strings; they must still read.
    assert Reason.CANNOT_HELP == "CompressionCannotHelp"
    assert Basis.ENGINES_CANNOT_HELP == "cannotHelp"
    assert Reason.SETTLING_AFTER_SCALE == "SettlingAfterScale"
    assert Reason.SETTLING_AFTER_RATIO_CHANGE == "SettlingAfterRatioChange"
    assert PromReason.NO_DATA == "NoData"
    assert json.dumps({"reason": Reason.ABOVE_TARGET}) == '{"reason": "LatencyAboveTarget"}'


def test_no_word_is_in_two_lists() -> None:
    """One "no data", one "outside bounds": a value names one thing."""
    lists = [{str(m) for m in e} for e in (Reason, PromReason)]
    assert lists[0] & lists[1] == set()


def test_a_trial_with_a_word_this_version_does_not_know_is_dropped() -> None:
    trial = {
        "time": "2026-01-01T00:00:00Z",
        "from": 0.3,
        "to": 0.35,
        "p99BeforeSeconds": 0.5,
        "requestRateBefore": 2.0,
    }
    assert effect_from_status({"trial": trial | {"basis": "measured"}}).trial is not None
    assert effect_from_status({"trial": trial | {"basis": "guessed"}}).trial is None
    verdict = trial | {
        "basis": "measured",
        "judgedTime": "2026-01-01T00:02:00Z",
        "p99AfterSeconds": 0.4,
        "requestRateAfter": 2.0,
    }
    assert effect_from_status({"lastTrial": verdict | {"outcome": "Improved"}}).last is not None
    assert effect_from_status({"lastTrial": verdict | {"outcome": "Better"}}).last is None
    assert Outcome("Improved") is Outcome.IMPROVED
