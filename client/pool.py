"""GatewayPool: one client over several gateways (``serve --gateway-count N``, or
gateways in front of separate engines), spreading requests and failing over.

Each address gets its own AsyncClient (its own session, heartbeats and reconnects).
A request goes to the connected gateway with the fewest requests this pool has in
flight there (ties rotate). A gateway that is gone is skipped until its client has
a session again; requests already in flight on it fail with the retryable
SessionLost (as with one AsyncClient): retrying through the pool sends them to a
gateway that is up. A gateway that is down at ``connect`` is retried in the
background.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

from codec import AbortAck, HealthReply, RequestOptions, RequestOutput, SamplingParams

from .aio import AsyncClient, RequestStream
from .errors import GatewayUnavailable
from .results import CompletionCalls

__all__ = ["GatewayPool", "PoolStream"]

_RETRY_CONNECT_S = 1.0


class PoolStream:
    """A request's outputs (as RequestStream); the gateway is picked when iteration
    starts. ``gateway`` is the address it went to."""

    def __init__(
        self,
        pool: GatewayPool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ):
        self._pool = pool
        self._args = args
        self._kwargs = kwargs
        self._stream: RequestStream | None = None
        self._client: AsyncClient | None = None
        self.gateway: str | None = None

    @property
    def request_id(self) -> str | None:
        return None if self._stream is None else self._stream.request_id

    def __aiter__(self) -> PoolStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._stream is None:
            client = await self._pool._pick()
            self._client, self.gateway = client, client.address
            self._stream = client.generate(*self._args, **self._kwargs)
            self._pool._owners[self._stream.request_id] = client
        try:
            out = await self._stream.__anext__()
        except BaseException:
            self._release()
            raise
        if self._stream._done:
            self._release()
        return out

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
        self._release()

    def _release(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._stream is not None:
            self._pool._in_flight[client] -= 1
            self._pool._owners.pop(self._stream.request_id, None)


class GatewayPool(CompletionCalls):
    """Several gateways as one client; use as ``async with GatewayPool(addresses) as pool``.

    Keyword arguments go to each AsyncClient (``reconnect_timeout_s`` also bounds how
    long a request waits for any gateway to be up).
    """

    def __init__(self, addresses: Sequence[str], **client_kwargs: Any):
        if not addresses:
            raise ValueError("GatewayPool needs at least one address")
        self._client_kwargs = client_kwargs
        self.clients = [AsyncClient(address, **client_kwargs) for address in addresses]
        self._reconnect_timeout_s = client_kwargs.get("reconnect_timeout_s", 30.0)
        self._in_flight: dict[AsyncClient, int] = {c: 0 for c in self.clients}
        self._owners: dict[str, AsyncClient] = {}
        self._turn = itertools.count()
        self._request_ids = itertools.count(1)
        self._retries: list[asyncio.Task[None]] = []
        self._prefix = self.clients[0].identity.decode()[-6:]

    async def __aenter__(self) -> GatewayPool:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        """Connect to every gateway; returns once one has a session (the others keep
        trying in the background). Raises GatewayUnavailable when none answers within
        ``connect_timeout_s``."""
        self._retries = [asyncio.ensure_future(self._join(c)) for c in self.clients]
        timeout = self._client_kwargs.get("connect_timeout_s", 60.0)
        try:
            async with asyncio.timeout(timeout):
                while not self.connected:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            await self.aclose()
            raise GatewayUnavailable(
                f"none of {len(self.clients)} gateways answered within {timeout}s: "
                + ", ".join(c.address for c in self.clients)
            ) from None

    async def _join(self, client: AsyncClient) -> None:
        """Connect ``client``; if its gateway is down, try again every second."""
        index = self.clients.index(client)
        try:
            await client.connect()
            return
        except GatewayUnavailable:
            pass
        while True:
            await asyncio.sleep(_RETRY_CONNECT_S)
            fresh = AsyncClient(client.address, **self._client_kwargs)
            try:
                await fresh.connect()
            except GatewayUnavailable:
                continue
            self._in_flight[fresh] = 0
            self.clients[index] = fresh
            return

    async def aclose(self) -> None:
        for task in self._retries:
            task.cancel()
        for task in self._retries:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(c.aclose() for c in self.clients))

    @property
    def connected(self) -> list[str]:
        """Addresses of the gateways with a session now."""
        return [c.address for c in self.clients if c.connected]

    def in_flight(self) -> dict[str, int]:
        """This pool's requests in flight, per gateway address."""
        return {c.address: self._in_flight.get(c, 0) for c in self.clients}

    async def _pick(self) -> AsyncClient:
        """The connected gateway with the fewest requests in flight (ties rotate)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._reconnect_timeout_s
        while True:
            up = [c for c in self.clients if c.connected]
            if up:
                start = next(self._turn) % len(up)
                rotated = up[start:] + up[:start]
                chosen = min(rotated, key=self._in_flight.__getitem__)
                self._in_flight[chosen] += 1
                return chosen
            if loop.time() >= deadline:
                raise GatewayUnavailable(
                    f"none of {len(self.clients)} gateways had a session within"
                    f" {self._reconnect_timeout_s}s"
                )
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------ requests

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        stream: bool = True,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> PoolStream:
        """As AsyncClient.generate, on the least-loaded gateway that is up."""
        request_id = request_id or f"p{self._prefix}-{next(self._request_ids)}"
        kwargs = dict(stream=stream, request_id=request_id, options=options)
        return PoolStream(self, (prompt_token_ids, sampling), kwargs)

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[AbortAck]:
        """Abort some (None: all) of this pool's requests, on whichever gateway runs them."""
        if request_ids is None:
            targets = [c for c in self.clients if c.connected]
            return list(await asyncio.gather(*(c.abort(None) for c in targets)))
        by_client: dict[AsyncClient, list[str]] = {}
        for request_id in request_ids:
            owner = self._owners.get(request_id)
            if owner is not None:
                by_client.setdefault(owner, []).append(request_id)
        return list(await asyncio.gather(*(c.abort(ids) for c, ids in by_client.items())))

    async def health(self) -> dict[str, HealthReply | None]:
        """Each gateway's HealthReply (None for one without a session)."""

        async def one(client: AsyncClient) -> HealthReply | None:
            if not client.connected:
                return None
            with contextlib.suppress(GatewayUnavailable):
                return await client.health()
            return None

        replies = await asyncio.gather(*(one(c) for c in self.clients))
        return {c.address: r for c, r in zip(self.clients, replies, strict=True)}
