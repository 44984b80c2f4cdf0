"""Gateway-side failures, each mapped to one wire ErrorCode by the server."""

from __future__ import annotations

from codec import ErrorCode

__all__ = ["GatewayError", "RequestRejected", "EngineDead"]


class GatewayError(Exception):
    """Base class; ``code`` is what the client sees."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RequestRejected(GatewayError):
    """One request failed vLLM's input processing; carries vLLM's own message."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST):
        super().__init__(message)
        self.code = code


class EngineDead(GatewayError):
    """The engine process failed: live requests end with this, new ones are refused."""

    code = ErrorCode.ENGINE_DEAD
