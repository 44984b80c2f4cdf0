"""engine-gateway server: a ZeroMQ ROUTER in front of a vLLM EngineCore.

Modules: server (sockets), sessions (rules, sans-IO), engine (the Engine
Protocol), vllm_engine (the only vLLM importer), fake_engine (unit tests and
benchmarks), cli (``engine-gateway serve``). Importing this package does not
import vLLM.
"""

from .engine import Engine, EngineInfo
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
