"""Workloads and load loops: closed-loop concurrency and open-loop Poisson arrivals.

Rule: a target is anything with ``async stream(prompt, max_tokens) -> RequestRecord``;
the loops here know nothing of transports. Every run is seeded.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Workload", "RequestRecord", "RunResult", "closed_loop", "open_loop"]


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths (fixed, or uniform in [lo, hi]) and the vocabulary to draw from."""

    prompt_len: tuple[int, int] = (64, 64)
    output_len: tuple[int, int] = (64, 64)
    vocab_size: int = 512
    seed: int = 0

    def requests(self, count: int, salt: int = 0) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed * 1_000_003 + salt)
        out = []
        for _ in range(count):
            plen = rng.randint(*self.prompt_len)
            prompt = [rng.randrange(4, self.vocab_size) for _ in range(plen)]
            out.append((prompt, rng.randint(*self.output_len)))
        return out


def model_shape(model: str) -> tuple[int, int | None]:
    """``model``'s vocabulary size (prompts are drawn from [4, it)) and its context length
    (``max_position_embeddings``, None if its config names none), from its config."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model).get_text_config()
    return text.vocab_size, getattr(text, "max_position_embeddings", None)


@dataclass
class RequestRecord:
    """Client-side timings of one request (monotonic seconds)."""

    start: float
    prompt_len: int = 0
    first_token: float | None = None
    end: float | None = None
    output_tokens: int = 0
    # Arrival time of each frame's tokens, as C doubles: the garbage collector walks a list of
    # floats item by item, and at c=1024 x 512 tokens those walks paused the load generator's
    # event loop for tens of ms (the gateway's and HTTP's client, not the direct client's,
    # which runs in its own process).
    token_times: array.array = field(default_factory=lambda: array.array("d"))
    error: str | None = None  # what failed it (an ErrorCode name in the gateway bench)
    error_message: str = ""  # what the failure said (the gateway's message)

    def got(self, n_tokens: int) -> None:
        """Record a frame of ``n_tokens`` new tokens arriving now (frames with none are ignored)."""
        if n_tokens:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
            self.token_times.append(now)
            self.output_tokens += n_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready data (how the direct driver's process sends it back)."""
        return {**dataclasses.asdict(self), "token_times": self.token_times.tolist()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{**data, "token_times": array.array("d", data["token_times"])})

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass
class RunResult:
    records: list[RequestRecord]
    wall_s: float


Stream = Callable[[list[int], int], Awaitable[RequestRecord]]


async def closed_loop(
    stream: Stream, requests: list[tuple[list[int], int]], concurrency: int
) -> RunResult:
    """Keep ``concurrency`` requests in flight until all ``requests`` are done."""
    queue = list(reversed(requests))
    records: list[RequestRecord] = []

    async def worker() -> None:
        while queue:
            prompt, max_tokens = queue.pop()
            records.append(await stream(prompt, max_tokens))

    start = time.monotonic()
    async with asyncio.TaskGroup() as tasks:
        for _ in range(min(concurrency, len(requests))):
            tasks.create_task(worker())
    return RunResult(records, time.monotonic() - start)


async def open_loop(
    stream: Stream,
    requests: list[tuple[list[int], int]],
    rate: float,
    seed: int = 0,
    *,
    arrival: str = "poisson",
    max_concurrency: int | None = None,
) -> RunResult:
    """Start requests at ``rate`` per second, whatever is in flight: Poisson arrivals
    (exponential gaps) or ``arrival="constant"`` (even gaps); ``rate`` inf starts all at
    once. ``max_concurrency`` caps requests in flight (later ones wait their turn)."""
    if arrival not in ("poisson", "constant"):
        raise ValueError(f"arrival must be poisson or constant, got {arrival!r}")
    rng = random.Random(seed)
    records: list[RequestRecord] = []
    cap = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(prompt: list[int], max_tokens: int) -> None:
        if cap is None:
            records.append(await stream(prompt, max_tokens))
            return
        async with cap:
            records.append(await stream(prompt, max_tokens))

    start = time.monotonic()
    async with asyncio.TaskGroup() as tasks:
        for prompt, max_tokens in requests:
            tasks.create_task(one(prompt, max_tokens))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate) if arrival == "poisson" else 1 / rate)
    return RunResult(records, time.monotonic() - start)
