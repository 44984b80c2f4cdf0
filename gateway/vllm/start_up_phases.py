"""One line per start-up phase of each engine rank, from inside vLLM's EngineCore process.

vLLM's EngineCore builds its executor (which loads the weights), then profiles memory,
sizes the KV cache and warms the model up, logging ~100 lines of its own on the way; a
reader could not tell which phase a slow start was in, nor which rank was up. The plugin
wraps those steps so each says, on one line, what it starts and how long the one before
took (docs/RUNNING.md, "Start-up"). The lines go through vLLM's logger, which vLLM
configures in each of its processes; they start with ``START_UP``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

START_UP = "engine-gateway start-up"


def announce_start_up_phases() -> None:
    """Wrap vLLM's Executor construction and EngineCore's KV-cache set-up (once per
    process) so each phase of a rank's start-up is logged as it begins."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.abstract import Executor

    if getattr(EngineCore, "_engine_gateway_phases", False):
        return
    EngineCore._engine_gateway_phases = True
    Executor.__init__ = _loading_announced(Executor.__init__)
    EngineCore._initialize_kv_caches = _kv_cache_set_up_announced(EngineCore._initialize_kv_caches)


def _logger() -> Any:
    from vllm.logger import init_logger

    return init_logger("vllm.engine_gateway")


def _rank(vllm_config: Any) -> str:
    """The data-parallel rank: vLLM runs each rank of a dense model as an independent
    engine (its ``data_parallel_rank`` reads 0 there), and keeps the rank in
    ``data_parallel_index``."""
    parallel = vllm_config.parallel_config
    return f"rank {getattr(parallel, 'data_parallel_index', parallel.data_parallel_rank)}"


def _loading_announced(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        _logger().info(
            "%s, %s: loading the weights of %s",
            START_UP,
            _rank(vllm_config),
            vllm_config.model_config.model,
        )
        started = time.monotonic()
        init(self, vllm_config, *args, **kwargs)
        self._engine_gateway_loaded_s = time.monotonic() - started

    return __init__


def _kv_cache_set_up_announced(initialize: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initialize)
    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        log, rank = _logger(), _rank(vllm_config)
        loaded_s = getattr(self.model_executor, "_engine_gateway_loaded_s", None)
        loaded = f"weights loaded in {loaded_s:.1f} s; " if loaded_s is not None else ""
        log.info("%s, %s: %sprofiling memory to size the KV cache", START_UP, rank, loaded)
        started = time.monotonic()
        executor = self.model_executor
        warm_up = executor.compile_or_warm_up_model

        def compile_or_warm_up_model(*args: Any, **kwargs: Any) -> Any:
            cache = vllm_config.cache_config
            log.info(
                "%s, %s: KV cache of %s blocks of %s tokens; warming the model up",
                START_UP,
                rank,
                cache.num_gpu_blocks,
                cache.block_size,
            )
            return warm_up(*args, **kwargs)

        executor.compile_or_warm_up_model = compile_or_warm_up_model
        try:
            config = initialize(self, vllm_config)
        finally:
            del executor.compile_or_warm_up_model  # the class's method again
        log.info(
            "%s, %s: up (KV-cache set-up and warm-up took %.1f s)",
            START_UP,
            rank,
            time.monotonic() - started,
        )
        return config

    return _initialize_kv_caches
