"""engine-gateway client library: needs only pyzmq and msgspec.

``AsyncClient`` (asyncio) and ``Client`` (blocking) speak docs/PROTOCOL.md to
a gateway; results are the codec's typed structs, errors are ClientError
subclasses carrying the gateway's ErrorCode.
"""

from codec import ErrorCode, FinishReason, RequestOptions, RequestOutput, SamplingParams

from .aio import AsyncClient
from .errors import ClientError, GatewayUnavailable, RequestFailed, RequestOverloaded
from .keys import load_client_keys
from .results import Completion
from .sync import Client

__all__ = [
    "AsyncClient",
    "Client",
    "Completion",
    "ClientError",
    "RequestFailed",
    "RequestOverloaded",
    "GatewayUnavailable",
    "load_client_keys",
    "SamplingParams",
    "RequestOptions",
    "RequestOutput",
    "FinishReason",
    "ErrorCode",
]
