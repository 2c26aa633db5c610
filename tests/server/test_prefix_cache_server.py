"""The prefix cache behind a real server: a repeated prompt skips its cached prefix
(counted in /metrics), and a hot model swap starts the new model with an empty cache,
even for the same weights (a cache is per engine, and a swap builds a new engine)."""

from __future__ import annotations

import re
import time

import httpx

from tests.server.conftest import APPS

PROMPT = "You are a careful assistant. Answer briefly and exactly. " * 2  # ~114 tokens


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(rf"^{name} ([\d.e+]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def _infer(base: str, text: str) -> str:
    r = httpx.post(f"{base}/infer", json={"input": text, "max_length": 4}, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["output"])


def test_repeats_hit_and_a_swap_empties_the_cache(make_server, auth) -> None:  # type: ignore[no-untyped-def]
    with make_server() as base:
        first = _infer(base, PROMPT + "Q1")
        assert _metric(base, "slimspec_prefix_cache_hit_tokens_total") == 0
        assert _metric(base, "slimspec_prefix_cache_bytes") > 0
        assert _infer(base, PROMPT + "Q1") == first
        hit = _metric(base, "slimspec_prefix_cache_hit_tokens_total")
        assert hit >= 96  # six 16-token blocks of the prompt at least
        assert _metric(base, "slimspec_prefix_cache_hits_total") == 1
        lookups = _metric(base, "slimspec_prefix_cache_lookups_total")
        r = httpx.post(
            f"{base}/admin/swap",
            headers=auth,
            timeout=120,
            json={"target": "tiny-a", "draft": "tiny-a-draft", "version": "v2"},
        )
        assert r.status_code == 200, r.text
        service = APPS[base].state.service
        deadline = time.monotonic() + 30
        while service._retired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not service._retired
        assert _metric(base, "slimspec_prefix_cache_bytes") == 0  # the old cache went
        # the same weights, the same prompt: looked up, but nothing is cached yet
        assert _infer(base, PROMPT + "Q1") == first
        assert _metric(base, "slimspec_prefix_cache_lookups_total") > lookups
        assert _metric(base, "slimspec_prefix_cache_hit_tokens_total") == hit
        assert _infer(base, PROMPT + "Q2")  # and the new cache fills again
        assert _metric(base, "slimspec_prefix_cache_hit_tokens_total") > hit
