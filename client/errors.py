"""Exceptions the client library raises; each carries the gateway's ErrorCode."""

from __future__ import annotations

from codec import ErrorCode

__all__ = ["ClientError", "RequestFailed", "RequestOverloaded", "GatewayUnavailable"]


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
    """No answer from the gateway within the heartbeat timeout, or the client is closed."""
