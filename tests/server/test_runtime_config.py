"""Runtime settings: pure ConfigMap parsing, and the watcher loop against a fake API."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from slimspec.server.runtime_config import (
    ConfigMapWatcher,
    RuntimeSettings,
    parse_settings,
    validate_setting,
)


def test_parse_valid_values() -> None:
    updates, errors = parse_settings(
        {"compression_ratio": " 0.5", "quality_threshold": "0.9", "fallback_strategy": "None"}
    )
    assert updates == {
        "compression_ratio": 0.5,
        "quality_threshold": 0.9,
        "fallback_strategy": "none",
    }
    assert errors == []


def test_parse_invalid_values_are_reported_and_skipped() -> None:
    updates, errors = parse_settings(
        {
            "compression_ratio": "0.99",
            "quality_threshold": "nan",
            "fallback_strategy": "sometimes",
            "other_key": "ignored",
        }
    )
    assert updates == {}
    assert len(errors) == 3
    assert any("compression_ratio" in e and "0.95" in e for e in errors)


def test_parse_mixed_keeps_the_good_ones() -> None:
    updates, errors = parse_settings({"compression_ratio": "abc", "quality_threshold": "0.8"})
    assert updates == {"quality_threshold": 0.8}
    assert len(errors) == 1


def test_strict_keys_for_admin() -> None:
    _, errors = parse_settings({"compresion_ratio": "0.3"}, strict_keys=True)
    assert errors and "unknown setting" in errors[0]
    assert parse_settings(None) == ({}, [])


def test_validate_rejects_bool_and_out_of_range() -> None:
    for key, raw in [
        ("compression_ratio", True),
        ("compression_ratio", -0.1),
        ("quality_threshold", 1.5),
        ("compression_ratio", "inf"),
    ]:
        try:
            validate_setting(key, raw)
        except ValueError:
            continue
        raise AssertionError(f"{key}={raw!r} accepted")


def test_settings_merge() -> None:
    s = RuntimeSettings().merged({"compression_ratio": 0.6, "bogus": 1})
    assert s.compression_ratio == 0.6 and s.quality_threshold == 0.95


class FakeCoreV1:
    """list + watch of one ConfigMap, as the kubernetes client's Watch drives them."""

    def __init__(self, events: list[dict[str, Any]], initial: dict[str, str]) -> None:
        self.events = events
        self.initial = initial
        self.calls = 0

    def list_namespaced_config_map(self, namespace: str, **kw: Any) -> Any:
        self.calls += 1
        if kw.get("watch"):
            raise AssertionError("Watch.stream uses its own call path")
        item = SimpleNamespace(data=self.initial)
        return SimpleNamespace(items=[item], metadata=SimpleNamespace(resource_version="1"))


def test_watcher_applies_initial_list_and_survives_errors(monkeypatch: Any) -> None:
    from kubernetes import watch

    events = [
        {"type": "MODIFIED", "object": SimpleNamespace(data={"compression_ratio": "bad"})},
        {"type": "MODIFIED", "object": SimpleNamespace(data={"compression_ratio": "0.6"})},
    ]

    def fake_stream(self: Any, func: Any, *args: Any, **kw: Any):  # type: ignore[no-untyped-def]
        yield from events
        raise RuntimeError("connection reset")  # the watcher must retry, not die

    monkeypatch.setattr(watch.Watch, "stream", fake_stream)
    seen: list[dict[str, Any]] = []
    api = FakeCoreV1(events, {"compression_ratio": "0.4", "fallback_strategy": "none"})
    w = ConfigMapWatcher("svc-runtime", "ns", apply=seen.append, resync_s=1, api=api).start()
    deadline = time.monotonic() + 5
    while api.calls < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    w.stop()
    assert seen[0] == {"compression_ratio": 0.4, "fallback_strategy": "none"}
    assert {"compression_ratio": 0.6} in seen
    assert api.calls >= 2  # re-listed after the failure
    assert w.last_error is not None
