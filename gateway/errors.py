"""Gateway-side failures, each mapped to one wire ErrorCode by the server."""

from __future__ import annotations

from codec import ErrorCode

__all__ = ["GatewayError", "RequestRejected", "SubmitFailed", "EngineDead", "WeightsIncomplete"]


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


class WeightsIncomplete(RequestRejected):
    """A weight update failed after some layers took new weights: the model mixes two
    sets of weights. Live requests end with this, and new ones are refused, until a
    complete update or a ReloadWeights succeeds."""

    def __init__(self, message: str):
        super().__init__(message, ErrorCode.WEIGHTS_INCOMPLETE)


class SubmitFailed(GatewayError):
    """Submitting one prepared request to a live engine failed; that request alone fails.

    Requests before it in the same ``add_requests`` call were submitted; those
    after it were not.
    """

    def __init__(self, engine_request_id: str, message: str):
        super().__init__(message)
        self.engine_request_id = engine_request_id


class EngineDead(GatewayError):
    """The engine process failed: live requests end with this, new ones are refused."""

    code = ErrorCode.ENGINE_DEAD
