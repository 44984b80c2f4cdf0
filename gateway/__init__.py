"""engine-gateway server: a ZeroMQ ROUTER in front of a vLLM EngineCore.

Modules: server (sockets), sessions (rules, sans-IO), multimodal_store (items held for
resending by hash, and the model-free item checks; sans-IO), engine (the Engine
Protocol), vllm (the only vLLM importer, a package), fake_engine (unit tests and
benchmarks), cli and serve (``engine-gateway serve``), group (``--gateway-count``).
Importing this package does not import vLLM; nothing here imports the benchmark.
"""

import sys

if sys.version_info < (3, 11):  # the client library (``client``) runs on 3.10 too
    raise ImportError("engine-gateway's server needs Python 3.11 or newer")

from .engine import Engine, EngineInfo  # noqa: E402
from .errors import EngineDead, GatewayError, RequestRejected
from .server import EXIT_ENGINE_DEAD, EXIT_OK, Gateway
from .sessions import GatewayLimits, SessionTable

__all__ = [
    "Engine",
    "EngineInfo",
    "Gateway",
    "GatewayLimits",
    "SessionTable",
    "GatewayError",
    "RequestRejected",
    "EngineDead",
    "EXIT_OK",
    "EXIT_ENGINE_DEAD",
]
