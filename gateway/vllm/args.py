"""Engine arguments and config: vLLM's own parser and ``VllmConfig``, the vllm-cpu
version shim, and what the config says about this machine (the CPU attention path).

Supported vLLM: ``SUPPORTED_VLLM``. Nothing here starts a process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from client.vllm_wheel import patch_vllm_cpu_version

SUPPORTED_VLLM = ">=0.32,<0.33"


def cpu_attention_isa(vllm_config: Any) -> str | None:
    """The CPU attention kernels vLLM's CPU backend picks for this model on this machine
    (``amx``, ``vec``, ``vec16``, ``neon``, ...); None on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    try:
        return _get_attn_isa(
            model_config.dtype,
            cache_config.block_size,
            model_config.get_head_size(),
            cache_config.cache_dtype,
        )
    except NotImplementedError as exc:  # a KV-cache dtype this CPU cannot run
        return f"none ({exc})"


def add_engine_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every vLLM engine argument, exactly as ``vllm serve`` accepts them."""
    patch_vllm_cpu_version()
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.add_cli_args(parser)


def make_engine_parser(**kwargs: Any) -> argparse.ArgumentParser:
    """vLLM's FlexibleArgumentParser (accepts --config YAML, dashes or underscores)."""
    patch_vllm_cpu_version()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser(**kwargs)


def engine_args_from_namespace(args: argparse.Namespace) -> Any:
    """Build vLLM's AsyncEngineArgs from parsed CLI arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(args)


def engine_config(engine_args: Any, gateway_count: int = 1, gateway_index: int = 0) -> Any:
    """vLLM's VllmConfig for ``engine_args``: reads the model's config, starts nothing.

    ``gateway_count`` > 1: the config of gateway ``gateway_index`` of that many sharing
    one engine group (vLLM's api-server count and rank; -1 for the supervisor).
    Raises what vLLM raises for a bad model or engine flag (ValueError and kin), and
    ValueError for a weight-transfer backend the gateway does not serve.
    """
    patch_vllm_cpu_version()
    from vllm.usage.usage_lib import UsageContext

    from .transfer import check_transfer_backend

    engine_args._api_process_count = gateway_count
    engine_args._api_process_rank = gateway_index
    config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    if config.model_config.is_multimodal_model and (
        engine_args.skip_tokenizer_init or engine_args.mm_processor_cache_gb
    ):
        # vLLM's multimodal budget and the gateway's probe of the model's processor need
        # the tokenizer; items arrive processed, and always with their tensors, so the
        # engine's processor cache (which would keep a copy of each) is left off.
        engine_args.skip_tokenizer_init = False
        engine_args.mm_processor_cache_gb = 0
        config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    check_transfer_backend(config)
    return config


def default_engine_args(model: str, **overrides: Any) -> Any:
    """Engine arguments for token-only serving: no tokenizer, no detokenization."""
    patch_vllm_cpu_version()
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(model=model, skip_tokenizer_init=True)
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


KV_EVENTS_FOLDER_PREFIX = "eg-kv-"


def enable_kv_events(engine_args: Any) -> None:
    """Turn on vLLM's KV cache events for the gateway's prefix index, on local ipc sockets
    in a fresh private folder: rank 0 publishes at ``ipc://FOLDER/kv`` and answers replay
    requests at ``ipc://FOLDER/replay``; rank r > 0 at those paths plus ``_dp{r}`` (the
    plugin's ipc offset: vLLM's own refuses ipc for rank > 0). Nothing leaves the host.
    Call before ``engine_config``; refuses a ``--kv-events-config`` already given."""
    import tempfile

    from vllm.config.kv_events import KVEventsConfig

    given = getattr(engine_args, "kv_events_config", None)
    if given is not None and getattr(given, "enable_kv_cache_events", False):
        raise ValueError(
            "--routing cache sets the engines' KV event endpoints itself; leave out"
            " --kv-events-config"
        )
    folder = tempfile.mkdtemp(prefix=KV_EVENTS_FOLDER_PREFIX)
    engine_args.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{folder}/kv",
        replay_endpoint=f"ipc://{folder}/replay",
        topic="kv",
    )


def remove_kv_events_folder(vllm_config: Any) -> None:
    """Remove the private folder ``enable_kv_events`` made for ``vllm_config``'s engines
    (their ipc sockets), if it made one; other endpoints are left alone."""
    import shutil
    from pathlib import Path

    config = getattr(vllm_config, "kv_events_config", None)
    endpoint = getattr(config, "endpoint", None) or ""
    if endpoint.startswith("ipc://"):
        folder = Path(endpoint.removeprefix("ipc://")).parent
        if folder.name.startswith(KV_EVENTS_FOLDER_PREFIX):
            shutil.rmtree(folder, ignore_errors=True)


RPC_FOLDER_PREFIX = "eg-rpc-"
_RPC_FOLDER_MAX_LEN = 64  # + "/" + a uuid4 (36): well inside AF_UNIX's 107 bytes


@contextlib.contextmanager
def private_rpc_folder() -> Iterator[str | None]:
    """vLLM's processes bind their ipc sockets at ``VLLM_RPC_BASE_PATH/<uuid>`` (default: the
    temporary directory) and leave the files there when they exit: seven a start of one
    engine, hundreds a test run. Unless the operator set ``VLLM_RPC_BASE_PATH``, point it,
    for this process and the engines it starts (they inherit it), at a fresh private
    folder, removed on the way out; yields that folder (None: the operator's is used)."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        yield None
        return
    folder = tempfile.mkdtemp(prefix=RPC_FOLDER_PREFIX)
    if len(folder) > _RPC_FOLDER_MAX_LEN:  # a socket path past AF_UNIX's 107 bytes fails
        os.rmdir(folder)
        yield None
        return
    os.environ["VLLM_RPC_BASE_PATH"] = folder
    try:
        yield folder
    finally:
        if os.environ.get("VLLM_RPC_BASE_PATH") == folder:
            del os.environ["VLLM_RPC_BASE_PATH"]
        shutil.rmtree(folder, ignore_errors=True)


def ipc_endpoint_for_rank(endpoint: str | None, rank: int) -> str | None:
    """Rank ``rank``'s copy of an ipc endpoint (the plugin's offset; vLLM offsets tcp ports)."""
    if endpoint is None or rank == 0:
        return endpoint
    return f"{endpoint}_dp{rank}"
