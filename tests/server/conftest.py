"""Fixtures for the server tests: a real uvicorn on loopback serving tiny random models.

Models come from tests/support/tiny_models.py (vocab 96); the tokenizer here is a
character-level one over the same 96 ids, so every prompt is valid for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from slimspec.server.service import ModelRef

TOKEN = "s3cret-admin-token"
APPS: dict[str, Any] = {}  # base URL -> FastAPI app, for tests that look inside


def char_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)][:93]
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return tok


class TinyModels:
    """Named tiny models for ModelRef.target/draft; 'none' draft = target-only engine."""

    def __init__(self) -> None:
        from tests.support.tiny_models import noisy_copy, tiny_model

        self.tokenizer = char_tokenizer()
        a = tiny_model("llama", seed=0)
        b = tiny_model("llama", seed=11)
        self.models = {
            "tiny-a": a,
            "tiny-a-draft": noisy_copy(a, noise=0.3, seed=1),
            "tiny-b": b,
            "tiny-b-draft": noisy_copy(b, noise=0.3, seed=12),
        }
        self.loads: list[ModelRef] = []
        self.load_delay_s: dict[str, float] = {}  # target name -> extra seconds (slow loads)

    def loader(self, ref: ModelRef) -> Any:
        import copy

        from slimspec.server.baseline import TargetOnlyEngine
        from slimspec.server.loading import has_draft

        self.loads.append(ref)
        time.sleep(self.load_delay_s.get(ref.target, 0.0))
        if ref.target.endswith("-slow"):  # a step takes >= 20 ms: timing tests on any machine
            return SlowEngine(self.loader(replace(ref, target=ref.target.removesuffix("-slow"))))
        if ref.target not in self.models:
            raise FileNotFoundError(f"no such model {ref.target!r}")
        # each engine gets its own copies: a swap must really hold two models
        target = copy.deepcopy(self.models[ref.target])
        if not has_draft(ref):
            return TargetOnlyEngine(target, self.tokenizer)
        from slimspec.decoding.decoder import SpeculativeDecoder

        draft = copy.deepcopy(self.models[ref.draft])  # type: ignore[index]
        return SpeculativeDecoder.from_models(target, draft, self.tokenizer, compression_ratio=0.3)


class SlowEngine:
    """Wraps an engine so that every step takes at least step_s (deadline/cancel tests)."""

    def __init__(self, inner: Any, step_s: float = 0.02) -> None:
        self._inner = inner
        self._step_s = step_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self) -> Any:
        t0 = time.monotonic()
        out = self._inner.step()
        time.sleep(max(0.0, self._step_s - (time.monotonic() - t0)))
        return out


@pytest.fixture(scope="session")
def tiny() -> TinyModels:
    return TinyModels()


def free_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


@contextlib.contextmanager
def running_server(cfg: Any, ready_timeout: float = 120.0) -> Iterator[str]:
    """uvicorn on a random loopback port in a thread; yields the base URL once ready."""
    import uvicorn
    from slimspec.server.app import create_app

    app = create_app(cfg)
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            try:
                r = httpx.get(f"{base}/readyz", timeout=2)
                if r.status_code == 200:
                    break
                if r.json().get("status") == "failed":
                    raise RuntimeError(r.text)
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.05)
        APPS[base] = app
        yield base
    finally:
        APPS.pop(base, None)
        server.should_exit = True
        thread.join(15)
        sock.close()


def tiny_config(tiny: TinyModels, **overrides: Any) -> Any:
    from slimspec.server.app import ServerConfig
    from slimspec.server.scheduler import SchedulerConfig
    from slimspec.server.service import Limits

    base = ServerConfig(
        model=ModelRef(target="tiny-a", draft="tiny-a-draft", version="v1", dtype="float32"),
        scheduler=SchedulerConfig(max_batch_size=8, max_queue=16, batch_wait_s=0.005),
        limits=Limits(
            max_new_tokens=256,
            max_input_tokens=400,
            max_input_chars=4000,
            max_body_bytes=200_000,
            request_timeout_s=60,
        ),
        admin_token=TOKEN,
        loader=tiny.loader,
        enable_gpu_metrics=False,
    )
    return replace(base, **overrides)


@pytest.fixture
def make_server(tiny: TinyModels) -> Callable[..., Any]:
    """make_server(**ServerConfig overrides) -> context manager yielding the base URL."""

    def make(**overrides: Any) -> Any:
        return running_server(tiny_config(tiny, **overrides))

    return make


@pytest.fixture(scope="module")
def server(tiny: TinyModels) -> Iterator[str]:
    """One shared server (speculative, tiny pair) for read-mostly tests."""
    with running_server(tiny_config(tiny)) as base:
        yield base


@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}
