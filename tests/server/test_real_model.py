"""`slimspec serve` as a user runs it (subprocess, real port) on a small real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import free_socket

pytestmark = pytest.mark.slow


def test_cli_serves_real_text(small_real_model: Path, tmp_path: Path) -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    env = {
        **os.environ,
        "MODEL_PATH": str(small_real_model),
        "MODEL_VERSION": "smol-1",
        "SLIMSPEC_ADMIN_TOKEN_FILE": str(token_file),
        "COMPRESSION_RATIO": "0.2",
    }
    cmd = [
        sys.executable,
        "-m",
        "slimspec",
        "serve",
        "--draft",
        str(small_real_model),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready in time"
            time.sleep(0.5)
        r = httpx.post(
            f"{base}/infer", json={"input": "Hello, world!", "max_length": 8}, timeout=300
        )
        body = r.json()
        assert r.status_code == 200, body
        assert body["output"].startswith("Hello, world!") and len(body["output"]) > 14
        assert body["compression_ratio"] == pytest.approx(0.2)
        assert body["model_version"] == "smol-1"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=300, max_retries=0)
        chat = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=8,
            temperature=0,
        )
        assert any(ch.isalpha() for ch in chat.choices[0].message.content)
        # Structured output on a real byte-level tokenizer: the schema is followed.
        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        }
        for fmt in (
            {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": True},
            },
            {"type": "json_object"},
        ):
            structured = client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": "Describe a person as JSON."}],
                max_tokens=60,
                temperature=0,
                response_format=fmt,  # type: ignore[arg-type]
                logprobs=True,
            )
            content = structured.choices[0].message.content
            if fmt["type"] == "json_schema":  # short by the schema: it ends
                assert structured.choices[0].finish_reason == "stop", content
                value = json.loads(content)
                assert set(value) == {"name", "age"} and isinstance(value["age"], int)
            else:  # any object: the model may still be writing one at max_tokens
                assert content.lstrip().startswith("{"), content
                if structured.choices[0].finish_reason == "stop":
                    assert isinstance(json.loads(content), dict)
            entries = structured.choices[0].logprobs.content
            assert b"".join(bytes(e.bytes) for e in entries).decode() == content
        auth = {"Authorization": "Bearer file-token"}
        assert httpx.get(f"{base}/admin/runtime", headers=auth).status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        assert 'version="smol-1"' in metrics and "slimspec_draft_tokens_total" in metrics
    finally:
        proc.terminate()
        proc.wait(30)
