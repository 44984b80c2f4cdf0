"""vLLM's OpenAI-compatible server (`vllm serve`) on loopback, as the oracle for text and
stop strings: completions with the prompt as token ids and the token ids returned."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.conftest import TEST_KV_CACHE_BYTES

ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenAIServer:
    """`python -m bench.vllm_cli serve MODEL` with the engine settings of the tests' engines
    (eager, seed 0, max_model_len); always stopped."""

    def __init__(self, model: str, max_model_len: int, *extra: str, env: dict | None = None):
        """``extra``: more ``vllm serve`` flags; ``env``: more environment variables."""
        self.model = model
        self.port = _free_port()
        self.log = Path(tempfile.mkdtemp(prefix="eg-openai-")) / "serve.log"
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "bench.vllm_cli", "serve", model,
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--enforce-eager", "--gpu-memory-utilization", "0.2",
                    "--max-model-len", str(max_model_len), "--seed", "0",
                    "--kv-cache-memory-bytes", str(TEST_KV_CACHE_BYTES),
                    "--disable-log-stats", "--uvicorn-log-level", "warning", *extra,
                ],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, process_group=0,
            )  # fmt: skip

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            url = f"http://127.0.0.1:{self.port}/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5):
                return
            time.sleep(1)
        raise RuntimeError(f"vllm serve did not start:\n{self.log.read_text()[-3000:]}")

    def complete(self, prompt_ids: list[int], n: int = 1, **fields: Any) -> list[Choice]:
        """One completion (streamed or not, as ``fields['stream']``), choices by index."""
        body = {"model": self.model, "prompt": prompt_ids, "n": n, "return_token_ids": True}
        body.update(fields)
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        choices = [Choice() for _ in range(n)]
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                if not body.get("stream"):
                    for c in json.load(response)["choices"]:
                        choices[c["index"]] = Choice(
                            c["text"], c["token_ids"], c["finish_reason"], c.get("stop_reason")
                        )
                    return choices
                for line in response:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    for c in json.loads(line[6:])["choices"]:
                        choice = choices[c["index"]]
                        choice.text += c["text"]
                        choice.token_ids += c.get("token_ids") or []
                        if c.get("finish_reason"):
                            choice.finish_reason = c["finish_reason"]
                            choice.stop_reason = c.get("stop_reason")
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from exc
        return choices

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
