"""Answers in vLLM's shapes, and the reading of bodies and queries, shared by the routes."""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, NamedTuple

import msgspec
from aiohttp import web

from client._compat import timeout
from client.errors import GatewayUnavailable, RequestFailed, RequestOverloaded
from codec import ErrorCode, FinishReason

from .bodies import HttpError, decode_json

ENCODE = msgspec.json.Encoder()
_PARAMETER = re.compile(r"\(parameter=(\w+)")

_STATUS_OF_CODE = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.INVALID_MESSAGE: 400,
    ErrorCode.UNSUPPORTED: 400,
    ErrorCode.FRAME_TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.DRAINING: 503,
    ErrorCode.ENGINE_DEAD: 503,
    ErrorCode.WEIGHTS_INCOMPLETE: 503,
    ErrorCode.SLOW_CONSUMER: 503,
}


class Ended(NamedTuple):
    finish_reason: FinishReason
    stop_reason: int | list[int] | None


def package_version() -> str:
    try:
        return importlib.metadata.version("engine-gateway")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def sse(event: Any) -> bytes:
    """One server-sent event: ``data: <JSON>`` and the blank line that ends it."""
    return b"data: " + ENCODE.encode(event) + b"\n\n"


def json_answer(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=ENCODE.encode(body), status=status, content_type="application/json")


def error_of(exc: BaseException) -> HttpError:
    """A gateway or client error as the HTTP error vLLM would answer."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, RequestOverloaded):
        return HttpError(429, f"the gateway is at a limit ({exc.limit}); retry later: {exc}")
    if isinstance(exc, RequestFailed):
        status = _STATUS_OF_CODE.get(exc.code, 500)
        message = exc.message
        if exc.code == ErrorCode.UNAUTHORIZED:  # the caller may; the gateway refuses the face
            status = 403
            message += (
                " (the gateway does not allow this face control calls: start the gateway"
                " with --control-key naming the face's --client-key, or, on loopback"
                " without CURVE, --control-open)"
            )
        named = _PARAMETER.search(message)  # vLLM's validation names the field so
        return HttpError(status, message, param=named.group(1) if named else None)
    if isinstance(exc, GatewayUnavailable):
        return HttpError(503, f"no gateway session: {exc}")
    if isinstance(exc, TimeoutError):
        return HttpError(504, "the gateway did not answer in time", kind="GatewayTimeout")
    return HttpError(500, f"{type(exc).__name__}: {exc}")


MAX_CONTROL_BODY_BYTES = 1 << 20  # a control route's body: names, paths, a few fields
READ_TIMEOUT_S = 60.0


async def read_body(request: web.Request, limit: int, timeout_s: float = READ_TIMEOUT_S) -> bytes:
    """The request's body, refused with 413 before it is read when it says it is over
    ``limit`` bytes (or as soon as it grows past it), and with 408 when it takes longer
    than ``timeout_s`` to arrive (a half-sent request holds nothing for ever)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise HttpError(413, f"request body of {declared} bytes; this route takes at most {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with timeout(timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, f"request body over {limit} bytes, this route's limit")
                chunks.append(chunk)
    except TimeoutError:
        raise HttpError(
            408, f"the request body did not arrive within {timeout_s:g} s", kind="RequestTimeout"
        ) from None
    return b"".join(chunks)


async def json_object(
    request: web.Request, *, allow_empty: bool = False, limit: int = MAX_CONTROL_BODY_BYTES
) -> dict[str, Any]:
    """A control route's JSON object body (``allow_empty``: no body reads as ``{}``)."""
    raw = await read_body(request, limit)
    if not raw.strip() and allow_empty:
        return {}
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise HttpError(400, "Request body must be a JSON object", kind="Bad Request")
    return body


def query_bool(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise HttpError(400, f"{name} must be a boolean, got {value!r}", param=name)


def query_int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise HttpError(400, f"{name} must be an integer, got {value!r}", param=name) from None
    if not low <= number <= high:
        raise HttpError(400, f"{name} must be in [{low}, {high}], got {number}", param=name)
    return number
