"""The words the tuner and the autoscaler write (pure): one enum per list.

`Reason`: every reason they put in status (status.compression.reason and its
history, status.autoscaling.reason, the CompressionEffective and
MetricsAvailable conditions), each spelled once. `EventReason`: the reasons of
the Events they post. `Condition`: the condition types they own. Why a
Prometheus reading failed is `prometheus.errors.PromReason` (its `NO_DATA` is
the one "no data" of all of them). String enums, so what status and Events
carry is the same text as before and what is read back compares equal.
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class Reason(StrEnum):
    # The ratio moved.
    ABOVE_TARGET = "LatencyAboveTarget"  # a move (either way) to bring p99 down
    BELOW_TARGET = "LatencyBelowTarget"  # lowered: headroom bought back on the safe side
    NO_SLOWER = "PredictedNoSlower"  # lowered: predicted at least as fast
    CANNOT_HELP = "CompressionCannotHelp"  # lowered or held: the engines say no ratio helps
    QUALITY_GUARD = "QualityBelowThreshold"
    OUTSIDE_BOUNDS = "OutsideBounds"  # the ratio or the replicas moved into the spec's bounds
    REVERTED_WORSE = "RevertedLatencyWorse"
    REVERTED_NO_GAIN = "RevertedNoGain"
    REVERTED_BREACH = "RevertedTargetBreached"
    REVERTED_UNCONFIRMED = "RevertedUnconfirmed"
    # Back to the old ratio for a paired trial's second window (verdict.py).
    RECHECK = "RecheckingPreviousRatio"
    # The ratio held.
    CONFIRMED = "ChangeConfirmed"
    HOLD_MEASURING = "MeasuringChange"
    HOLD_BAND = "WithinDeadBand"
    HOLD_COOLDOWN = "Cooldown"
    HOLD_LOW_TRAFFIC = "LowTraffic"
    SETTLING_AFTER_SCALE = "SettlingAfterScale"  # the replicas changed: capacity first
    HOLD_CONFIRMING = "AwaitingConfirmation"
    HOLD_QUALITY_UNKNOWN = "QualityUnknown"
    HOLD_AT_MAX = "AtMaxRatio"
    HOLD_AT_MIN = "AtMinRatio"
    HOLD_LOAD_NOT_LOWER = "LoadNotLower"
    HOLD_BACKING_OFF = "BackingOff"
    NO_PREDICTED_GAIN = "NoPredictedGain"  # a hold, and CompressionEffective=False
    HOLD_WOULD_BREACH = "LowerWouldBreachTarget"
    # The replicas (autoscaler).
    SCALED_UP = "LoadAboveTarget"
    SCALED_DOWN = "LoadBelowTarget"
    HOLD_STEADY = "AtRecommendation"
    HOLD_STABILISING = "StabilizationWindow"
    SETTLING_AFTER_RATIO_CHANGE = "SettlingAfterRatioChange"  # no scale-down yet
    # CompressionEffective.
    HEAD_SHARE_TOO_SMALL = "HeadShareTooSmall"
    ACCEPTANCE_LOSS = "AcceptanceLossOutweighsGain"
    PREDICTED_GAIN = "PredictedGain"
    NO_PREDICTIONS = "NoPredictions"
    # MetricsAvailable=True (False carries a PromReason).
    METRICS_OK = "MetricsOK"


@unique
class EventReason(StrEnum):
    COMPRESSION_CHANGED = "CompressionChanged"
    DRY_RUN_COMPRESSION = "DryRunCompression"
    SCALED = "Scaled"
    DRY_RUN_SCALE = "DryRunScale"
    METRICS_AVAILABLE = "MetricsAvailable"
    METRICS_UNAVAILABLE = "MetricsUnavailable"
    COMPRESSION_EFFECTIVE = "CompressionEffective"
    COMPRESSION_INEFFECTIVE = "CompressionIneffective"
    KEDA_NOT_INSTALLED = "KedaNotInstalled"


@unique
class Condition(StrEnum):
    METRICS_AVAILABLE = "MetricsAvailable"
    COMPRESSION_EFFECTIVE = "CompressionEffective"
