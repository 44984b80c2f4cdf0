"""FakeEngine: a deterministic in-process Engine, for unit tests and the bench ceiling.

Never used by integration tests. Sample ``i`` of a request emits
``(seed_of(prompt) + step) % vocab_size`` tokens, one per step, so outputs are
predictable; it honours max_tokens, ignore_eos and stop_token_ids, and can be
told to finish a request with EOS at a given step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from codec import EngineLoad, Generate, Logprobs

from .engine import EngineControls, EngineInfo, sample_engine_request_id
from .errors import EngineDead, RequestRejected, SubmitFailed

__all__ = ["FakeEngine", "FakeOutput", "FakePrepared"]


@dataclass(slots=True)
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs_tensors: None = None
    prefill_stats: None = None
    kv_transfer_params: dict | None = None
    events: None = None


@dataclass(slots=True)
class FakePrepared:
    request_id: str
    first_token: int
    max_tokens: int
    stop_token_ids: frozenset[int]
    produced: int = 0
    aborted: bool = False


@dataclass
class FakeEngine(EngineControls):
    """Emits one token per live request per step, every ``step_interval_s``."""

    info: EngineInfo = field(default_factory=lambda: EngineInfo("fake", 1024, 512, (2,), 20, 256))
    step_interval_s: float = 0.0
    tokens_per_step: int = 1
    _live: dict[str, FakePrepared] = field(default_factory=dict)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _dead: bool = False
    added: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    step_times: list[float] | None = None  # when a list: monotonic time of each step
    fail_submits: int = 0  # the next this many add_requests calls fail their first request
    paused: bool = False  # Pause(keep/abort): no steps until resume()
    calls: list[str] = field(default_factory=list)  # control calls made, in order
    weight_version: str | None = None

    def prepare(self, engine_request_id: str, request: Generate) -> list[FakePrepared]:
        prompt = request.prompt_token_ids
        if not prompt:
            raise RequestRejected("The decoder prompt cannot be empty")
        if max(prompt) >= self.info.vocab_size:
            raise RequestRejected(f"Token id {max(prompt)} is out of vocabulary")
        sampling = request.sampling
        n = sampling.n if sampling.n is not None else 1
        if n < 1:
            raise RequestRejected(f"n must be at least 1, got {n}.")
        if n > self.info.max_num_seqs:
            raise RequestRejected(
                f"n must be at most the engine's max_num_seqs ({self.info.max_num_seqs}), got {n}."
            )
        max_tokens = sampling.max_tokens
        if max_tokens is None:
            max_tokens = self.info.max_model_len - len(prompt)
        stops = set(sampling.stop_token_ids or ())
        if not sampling.ignore_eos:
            stops.update(self.info.eos_token_ids)
        return [
            FakePrepared(
                sample_engine_request_id(engine_request_id, i, n),
                (sum(prompt) + i) % self.info.vocab_size,
                max_tokens,
                frozenset(stops),
            )
            for i in range(n)
        ]

    async def add_requests(self, prepared: Sequence[FakePrepared]) -> None:
        if self._dead:
            raise EngineDead("the fake engine was killed")
        if self.fail_submits and prepared:
            self.fail_submits -= 1
            raise SubmitFailed(prepared[0].request_id, "the fake engine refused to submit it")
        for p in prepared:
            self._live[p.request_id] = p
            self.added.append(p.request_id)
        self._wakeup.set()

    async def abort_requests(self, engine_request_ids: Sequence[str]) -> None:
        for rid in engine_request_ids:
            self.aborted.append(rid)
            self._live.pop(rid, None)

    async def get_output(self) -> list[FakeOutput]:
        while True:
            if self._dead:
                raise EngineDead("the fake engine was killed")
            if self._live and not self.paused:
                break
            self._wakeup.clear()
            await self._wakeup.wait()
        if self.step_interval_s:
            await asyncio.sleep(self.step_interval_s)
        else:
            await asyncio.sleep(0)
        outputs = []
        vocab = self.info.vocab_size
        for rid, p in list(self._live.items()):
            tokens = []
            reason = stop = None
            for _ in range(self.tokens_per_step):
                token = (p.first_token + p.produced) % vocab
                p.produced += 1
                tokens.append(token)
                if token in p.stop_token_ids:
                    reason, stop = 0, token
                    break
                if p.produced >= p.max_tokens:
                    reason = 1
                    break
            if reason is not None:
                del self._live[rid]
            outputs.append(FakeOutput(rid, tokens, reason, stop))
        if self.step_times is not None:
            self.step_times.append(time.monotonic())
        return outputs

    async def run_outputs(self, on_step: Callable[[Sequence[FakeOutput]], None]) -> None:
        while True:
            on_step(await self.get_output())

    async def aclose(self) -> None:
        self._live.clear()

    async def pause(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(f"pause:{mode}")
        if mode == "abort":
            self.aborted.extend(self._live)
            self._live.clear()
        elif mode == "wait":
            while self._live:
                await asyncio.sleep(0.001)
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False
        self._wakeup.set()

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    def engine_stats(self) -> list:
        return []

    def engine_load(self) -> list[EngineLoad]:
        """One engine: what it holds now (running = live, nothing waits)."""
        live = len(self._live)
        return [EngineLoad(0, live, 0, 0.0, live)]

    def kill(self) -> None:
        """Simulate the engine process dying."""
        self._dead = True
        self._wakeup.set()
