"""The one exception the codec raises: the peer sent bytes we cannot accept."""

from __future__ import annotations

from .messages import ErrorCode

__all__ = ["ProtocolError"]


class ProtocolError(Exception):
    """The peer's fault: a frame or message that breaks the protocol.

    ``code`` is the wire ErrorCode to answer with; ``request_id`` names the
    request, and ``call_id`` the call (an Abort, a control or info call), when it could be
    read from the bad message, else None.
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        request_id: str | None = None,
        call_id: int | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        self.call_id = call_id

    def __repr__(self) -> str:
        return (
            f"ProtocolError({self.code.name}, {self.message!r}, request_id={self.request_id!r},"
            f" call_id={self.call_id!r})"
        )
