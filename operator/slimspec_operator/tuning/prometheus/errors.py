"""Why a Prometheus reading failed: `PromError` with a CamelCase reason (pure).

The tuner copies the reason into the MetricsAvailable condition, so an operator
can tell "Prometheus is down" from "the query matches nothing". Apart from the
client (client.py) so the pure query code can name them without the HTTP client.
"""

from __future__ import annotations

from enum import StrEnum, unique


@unique
class PromReason(StrEnum):
    UNREACHABLE = "PrometheusUnreachable"
    TIMEOUT = "PrometheusTimeout"
    HTTP_ERROR = "PrometheusHTTPError"
    BAD_RESPONSE = "PrometheusBadResponse"
    QUERY_ERROR = "QueryError"
    NO_DATA = "NoData"
    NOT_A_NUMBER = "NotANumber"
    AMBIGUOUS = "AmbiguousResult"
    INVALID_URL = "InvalidPrometheusURL"
    AUTH_FAILED = "PrometheusAuthFailed"
    NO_CREDENTIALS = "PrometheusCredentialsUnavailable"


# Errors that say nothing about the series, only about reaching Prometheus:
# one of these makes a whole sample unusable.
TRANSPORT_REASONS = frozenset(
    {
        PromReason.UNREACHABLE,
        PromReason.TIMEOUT,
        PromReason.HTTP_ERROR,
        PromReason.BAD_RESPONSE,
        PromReason.QUERY_ERROR,
        PromReason.INVALID_URL,
        PromReason.AUTH_FAILED,
        PromReason.NO_CREDENTIALS,
    }
)


class PromError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message

    @property
    def transport(self) -> bool:
        return self.reason in TRANSPORT_REASONS
