"""The operator's own Prometheus metrics (slimspec_operator_*)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILE_TOTAL = Counter(
    "slimspec_operator_reconcile_total",
    "Reconciliations of SlimSpecService resources",
    ["result"],  # ok | error | conflict (a status write lost a race; planned again)
)
RECONCILE_SECONDS = Histogram(
    "slimspec_operator_reconcile_duration_seconds",
    "Time of one reconciliation",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
ROLLOUTS_TOTAL = Counter(
    "slimspec_operator_rollouts_total",
    "Model rollouts by outcome",
    ["result"],  # started | switched | completed | rolled_back
)
ACTIONS_TOTAL = Counter(
    "slimspec_operator_actions_total",
    "API actions taken by the rollout plan",
    ["action"],
)
ROLLOUT_IN_PROGRESS = Gauge(
    "slimspec_operator_rollout_in_progress",
    "1 while a model rollout of the resource runs",
    ["namespace", "name"],
)
