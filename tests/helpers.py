"""Test tools: a table driven in memory, and a checker for the one-terminal invariant."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from client import AsyncClient, SamplingParams
from client.results import Accumulator
from codec import Error, ErrorCode, Outputs, RequestOutput, ServerMessage
from gateway.engine import EngineInfo
from gateway.fake_engine import FakeEngine, FakeOutput
from gateway.process_exit import exit_status
from gateway.sessions import Effects, GatewayLimits, SessionTable
from gateway.tiny_model import ensure_tiny_model

FAKE_INFO = EngineInfo("fake", 256, 512, (2, 3), 5, 64)


def tiny_model_variant(
    folder: Path, *, config: dict | None = None, generation_config: dict | None = None
) -> Path:
    """A copy of the tiny model in ``folder``: ``config`` fields set in its config.json,
    ``generation_config`` (if given) as its whole generation_config.json."""
    shutil.copytree(ensure_tiny_model(), folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def save_word_level_tokenizer(folder: Path, vocab_size: int, eos_token_id: int) -> None:
    """A tokenizer made locally (no hub) in ``folder``: token i is the word ``t<i>``,
    ``eos_token_id`` the EOS token; what ``--no-skip-tokenizer-init`` loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab_size)}
    eos = f"t{eos_token_id}"
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos, unk_token="t0")
    fast.save_pretrained(folder)


@dataclass
class _Instance:
    n: int
    terminals: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    errors: int = 0

    @property
    def ended(self) -> bool:
        return self.errors > 0 or all(self.terminals[i] for i in range(self.n))


@dataclass
class TerminalLedger:
    """Records what each (client, request) received; checks one terminal, nothing after.

    Call ``submitted`` for every accepted request and ``observe`` for every
    frame a client got, in order; ``assert_complete`` checks PROTOCOL.md §7.
    A request id may be reused after its terminal: each use is its own instance.
    """

    current: dict[tuple[bytes, str], _Instance] = field(default_factory=dict)
    finished: list[_Instance] = field(default_factory=list)
    after_terminal: list[tuple[bytes, str]] = field(default_factory=list)
    tokens: dict[tuple[bytes, str, int], list[int]] = field(
        default_factory=lambda: defaultdict(list)
    )

    def submitted(self, client_id: bytes, request_id: str, n: int = 1) -> None:
        key = (client_id, request_id)
        assert key not in self.current, f"{key} accepted twice while live"
        self.current[key] = _Instance(n)
        for index in range(n):
            self.tokens[(client_id, request_id, index)] = []

    def refused(self, client_id: bytes, request_id: str) -> None:
        """An Overloaded/refusal for a request the caller optimistically submitted."""
        self.current.pop((client_id, request_id), None)

    def _retire_if_ended(self, key: tuple[bytes, str]) -> None:
        instance = self.current[key]
        if instance.ended:
            self.finished.append(self.current.pop(key))

    def observe(self, client_id: bytes, msg: ServerMessage) -> None:
        if isinstance(msg, Outputs):
            for out in msg.outputs:
                self._observe_output(client_id, out)
        elif isinstance(msg, Error) and msg.request_id is not None:
            key = (client_id, msg.request_id)
            # DUPLICATE_REQUEST_ID names a live id but refers to the refused new Generate.
            if key in self.current and msg.code is not ErrorCode.DUPLICATE_REQUEST_ID:
                self.current[key].errors += 1
                self._retire_if_ended(key)

    def _observe_output(self, client_id: bytes, out: RequestOutput) -> None:
        key = (client_id, out.request_id)
        instance = self.current.get(key)
        if instance is None or instance.terminals[out.index]:
            self.after_terminal.append(key)
            return
        self.tokens[(client_id, out.request_id, out.index)].extend(out.new_token_ids)
        if out.finished is not None:
            instance.terminals[out.index] += 1
            self._retire_if_ended(key)

    def assert_complete(self) -> None:
        assert not self.after_terminal, f"frames after a terminal: {self.after_terminal[:5]}"
        assert not self.current, f"requests without a terminal: {list(self.current)[:5]}"
        for instance in self.finished:
            if instance.errors:  # one Error ended every sample still live
                assert instance.errors == 1
            else:
                assert all(instance.terminals[i] == 1 for i in range(instance.n))


class TableHarness:
    """A SessionTable over a FakeEngine's prepare(), stepped by hand; no I/O."""

    def __init__(self, limits: GatewayLimits = GatewayLimits(), info: EngineInfo = FAKE_INFO):
        self.engine = FakeEngine(info=info)
        self.table = SessionTable(info, self.engine.prepare, limits)
        self.now = 0.0
        self.submitted: list = []
        self.aborted: list[str] = []
        self.received: dict[bytes, list[ServerMessage]] = defaultdict(list)

    def apply(self, effects: Effects) -> Effects:
        for client_id, msg in effects.replies:
            self.received[client_id].append(msg)
        self.submitted.extend(effects.submit)
        self.aborted.extend(effects.abort)
        return effects

    def send(self, client_id: bytes, msg) -> Effects:
        return self.apply(self.table.on_message(client_id, msg, self.now))

    def step(self, *outputs: FakeOutput) -> list:
        effects = self.table.on_step(list(outputs), self.now)
        for client_id, msg in effects.replies:
            self.received[client_id].append(msg)
        self.aborted.extend(effects.abort)
        return effects.replies

    def take(self, client_id: bytes) -> list[ServerMessage]:
        msgs, self.received[client_id] = self.received[client_id], []
        return msgs


class RecordingClient(AsyncClient):
    """An AsyncClient that also keeps every Outputs frame it read off the socket.

    Counting terminals from these raw frames (not from ``generate``, which stops
    at the terminal) sees a second terminal or an output after it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.frames: list[Outputs] = []

    def _on_outputs(self, msg: Outputs) -> None:
        self.frames.append(msg)
        super()._on_outputs(msg)

    def terminals(self, request_id: str) -> list[int]:
        """Per frame index, how many terminals ``request_id`` got (in frame order)."""
        return [
            i
            for i, frame in enumerate(self.frames)
            for out in frame.outputs
            if out.request_id == request_id and out.finished is not None
        ]

    def outputs_after_terminal(self, request_id: str) -> int:
        """How many outputs for ``request_id`` arrived after its (first) terminal."""
        seen_terminal, after = False, 0
        for frame in self.frames:
            for out in frame.outputs:
                if out.request_id != request_id:
                    continue
                if seen_terminal:
                    after += 1
                seen_terminal |= out.finished is not None
        return after


async def stream_outcome(stream) -> BaseException | None:
    """Read a request stream to its end: the exception it ended with, or None."""
    try:
        async for _ in stream:
            pass
    except Exception as exc:
        return exc
    return None


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts) or never was."""
    return exit_status(pid) is not None or not Path(f"/proc/{pid}").exists()


def wait_for(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ---- streams on a real engine, watched as they run (RecordingClient's frames)


def greedy(max_tokens: int, **extra: object) -> SamplingParams:
    """Exactly ``max_tokens`` greedy tokens (no EOS stops them), plus any other fields."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


async def collect(client, prompt, sampling, request_id=None):  # noqa: ANN001, ANN201
    """A streamed request's Completion (``tokens_so_far`` sees its tokens as they come)."""
    acc = Accumulator()
    async for out in client.generate(prompt, sampling, request_id=request_id):
        acc.add(out)
    (completion,) = acc.done.values()
    return completion


def tokens_so_far(client: RecordingClient, request_id: str) -> int:
    """Tokens ``request_id`` has streamed to ``client`` so far."""
    return sum(
        len(o.new_token_ids) for f in client.frames for o in f.outputs if o.request_id == request_id
    )


async def until(predicate, timeout: float = 30.0) -> None:  # noqa: ANN001
    """Wait until ``predicate()`` holds (TimeoutError after ``timeout`` seconds)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


def noise_image(width: int, height: int, seed: int):  # noqa: ANN201 - a PIL image
    """A deterministic RGB noise image (the same on every machine)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def sockets_under(folder) -> list[str]:  # noqa: ANN001
    """Unix socket files anywhere under ``folder`` (what a process left behind)."""
    import stat
    from pathlib import Path

    return [str(path) for path in Path(folder).rglob("*") if stat.S_ISSOCK(path.lstat().st_mode)]
