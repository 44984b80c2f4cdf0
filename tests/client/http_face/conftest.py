"""The HTTP face over a gateway on the tiny model, beside ``vllm serve`` on the same model with
the routes the frameworks use (``--enable-scale-out``, dev mode), both with bearer token
``TOKEN``; one of each per test file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import TEST_MAX_MODEL_LEN, cpu_engine_args, engine_gateway

TOKEN = "operator-token"
ROOT = Path(__file__).resolve().parents[3]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Http:
    """A JSON client of one base URL: ``(status, body)`` of each call; SSE as a list."""

    def __init__(self, session: aiohttp.ClientSession, base: str):
        self.session = session
        self.base = base

    async def post(
        self, path: str, body: Any = None, *, headers: dict | None = AUTH, raw: bytes | None = None
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        async with self.session.post(
            self.base + path,
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as response:
            return response.status, await _read(response)

    async def get(self, path: str, *, headers: dict | None = AUTH) -> tuple[int, Any]:
        async with self.session.get(self.base + path, headers=headers or {}) as response:
            return response.status, await _read(response)


async def _read(response: aiohttp.ClientResponse) -> Any:
    text = await response.text()
    if response.content_type == "text/event-stream":
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        return [e if e == "[DONE]" else json.loads(e) for e in events]
    with contextlib.suppress(ValueError):
        return json.loads(text)
    return text


@contextlib.asynccontextmanager
async def face_over(gateway, **face_kwargs: Any) -> AsyncIterator[tuple[Any, str]]:
    """The HTTP face over ``gateway`` on a free port: ``(face, base URL)``."""
    from client.http_face.app import HttpFace, serving
    from client.pool import GatewayPool

    async with GatewayPool([gateway.addresses[0]], name="http-face") as pool:
        info = await pool.clients[0].model_info()
        face = HttpFace(pool, info.model, **face_kwargs)
        async with serving(face, "127.0.0.1", 0) as port:
            yield face, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
async def servers() -> AsyncIterator[dict[str, Any]]:
    """``{"vllm": Http, "face": Http, "face_state": HttpFace, "gateway": Gateway}``."""
    from gateway.auth import ControlPolicy
    from gateway.tiny_model import ensure_tiny_model
    from tests.client.text.openai_server import OpenAIServer

    model = str(ensure_tiny_model())
    vllm = OpenAIServer(
        model,
        TEST_MAX_MODEL_LEN,
        "--enable-scale-out",
        "--skip-tokenizer-init",
        "--api-key",
        TOKEN,
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    try:
        ready = asyncio.ensure_future(asyncio.to_thread(vllm.wait_ready))
        async with (
            engine_gateway(
                cpu_engine_args(enable_lora=True, max_lora_rank=8),
                control=ControlPolicy(open=True),
            ) as gateway,
            face_over(gateway, api_key=TOKEN) as (face, base),
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
        ):
            await ready
            yield {
                "vllm": Http(session, f"http://127.0.0.1:{vllm.port}"),
                "face": Http(session, base),
                "face_state": face,
                "gateway": gateway,
                "session": session,
            }
    finally:
        await asyncio.to_thread(vllm.stop)


def in_framework_venv(venv: str, script: str, *args: str, our_client: bool = False) -> dict:
    """``script`` (beside this file) run by the setup's ``venv`` python: its JSON line.
    ``our_client``: with this repository on its path (the native adapters' client)."""
    python = ROOT / venv / "bin" / "python"
    assert python.exists(), f"scripts/setup.sh makes {venv}"
    path = str(ROOT) if our_client else ""
    env = {**os.environ, "ENGINE_GATEWAY_TEST_TOKEN": TOKEN, "PYTHONPATH": path}
    done = subprocess.run(
        [python, str(Path(__file__).with_name(script)), *args],
        capture_output=True, text=True, timeout=240, env=env, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
