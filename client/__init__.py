"""engine-gateway client library: needs only pyzmq and msgspec.

``AsyncClient`` (asyncio) and ``Client`` (blocking) speak docs/PROTOCOL.md to
a gateway; results are the codec's typed structs, errors are ClientError
subclasses carrying the gateway's ErrorCode.
"""

from codec import (
    EmbeddingRule,
    ErrorCode,
    FinishReason,
    ItemSchema,
    MultimodalItem,
    RequestOptions,
    RequestOutput,
    SamplingParams,
    Tensor,
    TensorSchema,
)

from .aio import AsyncClient, RequestStream
from .errors import (
    ClientError,
    GatewayUnavailable,
    RequestFailed,
    RequestOverloaded,
    SessionLost,
)
from .keys import create_keys, load_client_keys
from .pool import GatewayPool, PoolStream
from .results import Completion
from .sync import Client

__all__ = [
    "AsyncClient",
    "GatewayPool",
    "PoolStream",
    "Client",
    "Completion",
    "ClientError",
    "RequestFailed",
    "RequestOverloaded",
    "GatewayUnavailable",
    "SessionLost",
    "RequestStream",
    "create_keys",
    "load_client_keys",
    "SamplingParams",
    "RequestOptions",
    "RequestOutput",
    "MultimodalItem",
    "Tensor",
    "ItemSchema",
    "TensorSchema",
    "EmbeddingRule",
    "FinishReason",
    "ErrorCode",
]
