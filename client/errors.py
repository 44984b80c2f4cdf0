"""Exceptions the client library raises; each carries the gateway's ErrorCode."""

from __future__ import annotations

from codec import ErrorCode

__all__ = [
    "ClientError",
    "RequestFailed",
    "RequestOverloaded",
    "GatewayUnavailable",
    "SessionLost",
]


class ClientError(Exception):
    """Base class of every error raised by the client library."""


class RequestFailed(ClientError):
    """The gateway ended or refused a request with an Error frame."""

    def __init__(self, request_id: str | None, code: ErrorCode, message: str):
        super().__init__(f"[{code.name}] {message}")
        self.request_id = request_id
        self.code = code
        self.message = message


class RequestOverloaded(ClientError):
    """Admission control refused the request; it was never started. Retry later."""

    def __init__(self, request_id: str, limit: str, limit_value: int, current: int, message: str):
        super().__init__(message)
        self.request_id = request_id
        self.limit = limit
        self.limit_value = limit_value
        self.current = current


class GatewayUnavailable(ClientError):
    """No session with the gateway: none within the wait allowed, or the client is closed."""

    retryable = False


class SessionLost(GatewayUnavailable):
    """The session ended while this request or call was in flight; retrying is safe.

    The gateway went silent past the heartbeat timeout (it died or restarted),
    or it no longer knew this client (its session expired). A request that was
    in flight was aborted by the gateway or died with it. The client opens a
    new session by itself; a retry waits for it.
    """

    retryable = True
