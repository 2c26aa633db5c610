"""The words the reconciler writes (pure): the reasons of its conditions and Events,
and the condition types it owns, each spelled once.

String enums: status and Events carry the same text as before, and what is read
back compares equal. The ownership conflict's reason is kube.ownership's
RESOURCE_CONFLICT (the tuner refuses with it too).
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class Reason(StrEnum):
    # Progressing / Degraded, and the Events of a rollout.
    UNKNOWN = "Unknown"  # not planned yet
    AS_EXPECTED = "AsExpected"
    PREPARING_MODEL = "PreparingModel"
    PREPARATION_FAILED = "PreparationFailed"
    CREATING = "Creating"
    WAITING_FOR_READY = "WaitingForReady"
    ROLLOUT_STARTED = "RolloutStarted"
    ROLLING_OUT = "RollingOut"
    TRAFFIC_SWITCHED = "TrafficSwitched"
    ROLLOUT_COMPLETE = "RolloutComplete"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    NOT_READY = "NotReady"
    ROLLED_BACK = "RolledBack"
    ROLLOUT_FAILED = "RolloutFailed"
    INVALID_SPEC = "InvalidSpec"  # a round refused: the spec cannot be read or applied
    # Ready.
    SCALED_TO_ZERO = "ScaledToZero"
    NOT_SERVING = "NotServing"
    ALL_REPLICAS_READY = "AllReplicasReady"
    PARTIALLY_READY = "PartiallyReady"
    NO_READY_REPLICAS = "NoReadyReplicas"
    # status.compression.reason of the reconciler's seed.
    INITIAL = "Initial"  # tuning on, nothing written by the tuner yet
    SPEC = "Spec"  # tuning off: the spec's ratio


@unique
class Condition(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
