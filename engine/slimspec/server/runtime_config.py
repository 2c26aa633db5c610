"""Runtime settings that change without a restart, and the ConfigMap watcher.

Keys (docs/contracts.md): compression_ratio, quality_threshold, fallback_strategy.
Parsing is pure (`parse_settings`); the watcher is a thin thread around the
kubernetes client's list+watch that hands parsed updates to a callback. Invalid
values are logged and ignored; nothing here ever raises into the server.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger(__name__)

FALLBACK_STRATEGIES = ("auto", "none")
RATIO_MAX = 0.95
KEYS = ("compression_ratio", "quality_threshold", "fallback_strategy")


@dataclass(frozen=True)
class RuntimeSettings:
    compression_ratio: float = 0.3
    quality_threshold: float = 0.95
    fallback_strategy: str = "auto"

    def merged(self, updates: Mapping[str, Any]) -> RuntimeSettings:
        return replace(self, **{k: v for k, v in updates.items() if k in KEYS})


def _number(raw: Any, lo: float, hi: float, key: str) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"{key} must be a number, got {raw!r}")
    try:
        v = float(raw.strip() if isinstance(raw, str) else raw)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {raw!r}") from None
    if not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{key} must be within {lo}..{hi}, got {raw!r}")
    return v


def validate_setting(key: str, raw: Any) -> Any:
    """One key's value, parsed and checked; ValueError with a clear message otherwise."""
    if key == "compression_ratio":
        return _number(raw, 0.0, RATIO_MAX, key)
    if key == "quality_threshold":
        return _number(raw, 0.0, 1.0, key)
    if key == "fallback_strategy":
        v = raw.strip().lower() if isinstance(raw, str) else raw
        if v not in FALLBACK_STRATEGIES:
            raise ValueError(f"{key} must be one of {FALLBACK_STRATEGIES}, got {raw!r}")
        return v
    raise ValueError(f"unknown setting {key!r}; known: {KEYS}")


def parse_settings(
    data: Mapping[str, Any] | None, *, strict_keys: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """ConfigMap data (or an admin body) -> (valid updates, error messages).

    Unknown keys are errors only with strict_keys (the admin API); a ConfigMap may
    carry other keys for other readers.
    """
    updates: dict[str, Any] = {}
    errors: list[str] = []
    for key, raw in (data or {}).items():
        if key not in KEYS:
            if strict_keys:
                errors.append(f"unknown setting {key!r}; known: {', '.join(KEYS)}")
            continue
        try:
            updates[key] = validate_setting(key, raw)
        except ValueError as exc:
            errors.append(str(exc))
    return updates, errors


class ConfigMapWatcher:
    """Watches one ConfigMap and calls `apply(updates)` on every valid change."""

    def __init__(
        self,
        name: str,
        namespace: str,
        apply: Callable[[dict[str, Any]], object],
        resync_s: int = 60,
        api: Any = None,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self._apply = apply
        self._resync_s = resync_s
        self._api = api
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="configmap-watch", daemon=True)
        self.last_error: str | None = None
        self.applied = 0

    def start(self) -> ConfigMapWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                # read KUBECONFIG now: the client's default path is fixed at its import
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
            self._api = client.CoreV1Api()
        return self._api

    def _handle(self, data: Mapping[str, Any] | None) -> None:
        updates, errors = parse_settings(data)
        for e in errors:
            log.warning("runtime ConfigMap %s/%s: ignoring %s", self.namespace, self.name, e)
        if updates:
            try:
                self._apply(updates)
                self.applied += 1
            except Exception:
                log.exception("applying runtime settings failed")

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                from kubernetes import watch

                api = self._client()
                sel = f"metadata.name={self.name}"
                lst = api.list_namespaced_config_map(self.namespace, field_selector=sel)
                for cm in lst.items:
                    self._handle(cm.data)
                w = watch.Watch()
                for ev in w.stream(
                    api.list_namespaced_config_map,
                    self.namespace,
                    field_selector=sel,
                    resource_version=lst.metadata.resource_version,
                    timeout_seconds=self._resync_s,  # ends the watch: re-list = resync
                ):
                    if self._stop.is_set():
                        w.stop()
                        break
                    if ev.get("type") in ("ADDED", "MODIFIED"):
                        self._handle(ev["object"].data)
                backoff = 1.0
                self.last_error = None
            except Exception as exc:  # apiserver down, 410 Gone, RBAC: retry, never crash
                self.last_error = str(exc)
                log.warning("runtime ConfigMap watch failed (%s); retrying in %.0fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                time.sleep(0)
