"""Entry point: `python -m slimspec_operator` / `slimspec-operator`.

Runs Kopf with this package's handlers (and the tuner's, when installed), a
liveness endpoint and a Prometheus endpoint for slimspec_operator_* metrics.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
from collections.abc import Sequence

import kopf
from prometheus_client import start_http_server

OPTIONAL_HANDLER_MODULES = ("slimspec_operator.tuning.handlers",)


def load_handlers() -> list[str]:
    """Import the handler modules; Kopf registers handlers at import time."""
    importlib.import_module("slimspec_operator.rollout.handlers")
    loaded = ["slimspec_operator.rollout.handlers"]
    for name in OPTIONAL_HANDLER_MODULES:
        if _installed(name):  # the tuner ships separately
            importlib.import_module(name)
            loaded.append(name)
    return loaded


def _installed(name: str) -> bool:
    """Whether module `name` can be imported; False also when its package is absent
    (find_spec of a submodule imports the package, and raises without it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


class _QuietRoutine(logging.Filter):
    """Drop Kopf's per-tick success lines of our routine triggers (timer, Deployment
    events); they would log every few seconds per resource. Failures still show."""

    ROUTINE = (
        "Timer 'on_timer' succeeded",
        "Handler 'on_deployment' succeeded",
        "Handler 'on_job' succeeded",
        "Timer 'tuning_timer' succeeded",
        "Handler 'on_ratio' succeeded",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.ROUTINE)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="slimspec-operator", description=__doc__)
    p.add_argument(
        "--standalone",
        action="store_true",
        default=env("SLIMSPEC_OPERATOR_STANDALONE", "") in ("1", "true"),
        help="no peering: this process handles everything (one replica only)",
    )
    p.add_argument(
        "--peering",
        default=env("SLIMSPEC_OPERATOR_PEERING") or None,
        help="(Cluster)KopfPeering object shared by the replicas; then peering is "
        "mandatory (crds/kopf-peering.yaml). Unset: Kopf's 'default' peering if it exists",
    )
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[n for n in env("SLIMSPEC_OPERATOR_NAMESPACES", "").split(",") if n],
        help="watch only this namespace (repeatable); default: the whole cluster",
    )
    p.add_argument(
        "--liveness",
        default=env("SLIMSPEC_OPERATOR_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="liveness endpoint URL ('' to disable)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("SLIMSPEC_OPERATOR_METRICS_PORT", "9100")),
        help="port of /metrics (0 to disable)",
    )
    p.add_argument("--verbose", "-v", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        logging.getLogger("kopf.objects").addFilter(_QuietRoutine())
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per Prometheus query
    loaded = load_handlers()
    logging.getLogger("slimspec_operator").info("handlers: %s", ", ".join(loaded))
    if args.metrics_port:
        start_http_server(args.metrics_port)
    kopf.run(
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,  # None: Kopf decides
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0
