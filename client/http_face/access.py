"""Who an HTTP caller is, and what it may make the face do: ``Access`` and ``Caller``.

The face is one client of its gateways, and a privileged one (its control routes need the
gateways to allow it control calls). An HTTP caller never borrows that: every privilege the
face holds as a gateway client is checked against the caller's own rights here. A caller
is its bearer token (hashed; any token under ``--open-data-routes``, where a token names a
caller without being checked), or its address when it sends none; the operator is the
caller whose token is ``--api-key``.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from aiohttp import web

from .bodies import HttpError

__all__ = ["Access", "Caller", "routing_key", "MAX_SESSION_ID_CHARS"]

MAX_SESSION_ID_CHARS = 192  # with the caller's key, within the gateways' 256 for a routing key


@dataclass(frozen=True, slots=True)
class Caller:
    """An HTTP caller: ``key`` scopes its request ids, aborts, routing keys and share of
    the gateways' budget; ``operator``: it sent the operator's token."""

    key: str
    operator: bool


def _bearer(request: web.Request) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme in any case, as
    vLLM reads it), as bytes; None without one."""
    header = request.headers.get("Authorization")
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    # aiohttp keeps bytes that are not UTF-8 as surrogates: compared as the bytes sent.
    return token.strip().encode("utf-8", "surrogateescape")


class Access:
    """The face's access rules: data routes need the operator's token unless
    ``open_data_routes``; control routes and privileged request fields always need it (and
    are refused on a face without one). An empty ``api_key`` is none, as vLLM reads it."""

    def __init__(self, api_key: str | None, open_data_routes: bool):
        self.api_key = api_key.encode("utf-8", "surrogateescape") if api_key else None
        self.open_data_routes = open_data_routes

    def caller(self, request: web.Request) -> Caller:
        token = _bearer(request)
        if token is None:
            return Caller(f"peer-{request.remote or 'unknown'}", False)
        operator = self.api_key is not None and hmac.compare_digest(token, self.api_key)
        return Caller("token-" + hashlib.sha256(token).hexdigest()[:24], operator)

    def data(self, request: web.Request) -> Caller:
        """The caller of a data route; 401 when it needs the token and lacks it."""
        caller = self.caller(request)
        if self.api_key is not None and not self.open_data_routes and not caller.operator:
            raise HttpError(401, self._refusal(request, "this route"))
        return caller

    def control(self, request: web.Request, what: str = "control routes") -> Caller:
        """The caller of a control route (or of a privileged field: ``what``); 401 unless
        it is the operator."""
        if self.api_key is None:
            raise HttpError(
                401,
                f"the operator's token is needed for {what}, and this face has none: start"
                " `engine-gateway http` with --api-key (or $VLLM_API_KEY)",
            )
        caller = self.caller(request)
        if not caller.operator:
            raise HttpError(401, self._refusal(request, what))
        return caller

    @staticmethod
    def _refusal(request: web.Request, what: str) -> str:
        if _bearer(request) is None:
            return (
                f"Unauthorized: the operator's token is needed for {what}"
                " (Authorization: Bearer <the face's --api-key>); none was sent"
            )
        return (
            "Unauthorized: the bearer token sent is not the face's --api-key, which is needed"
            f" for {what}"
        )


def routing_key(caller: Caller, request: web.Request) -> str | None:
    """X-Session-ID as the gateways' routing key, in the caller's own namespace (two
    callers' sessions of one name are two sessions)."""
    session = request.headers.get("X-Session-ID")
    if session is None:
        return None
    if len(session) > MAX_SESSION_ID_CHARS:
        raise HttpError(
            400, f"X-Session-ID longer than {MAX_SESSION_ID_CHARS} characters", param="X-Session-ID"
        )
    return f"{caller.key}:{session}"
