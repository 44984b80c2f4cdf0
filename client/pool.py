"""GatewayPool: one client over several gateways (``serve --gateway-count N``, or
gateways in front of separate engines), spreading requests and failing over.

Each address gets its own AsyncClient (its own session, heartbeats and reconnects).
A request goes to the connected gateway with the fewest requests this pool has in
flight there (ties rotate): ``policy="load"``. With ``policy="cache"`` the pool first asks
every connected gateway how much of the prompt its engines hold in their prefix caches
(PrefixQuery, one round trip each, concurrently) and sends the request where the most
tokens are cached, unless that gateway has more than ``1.5 * least + 8`` of this pool's
requests in flight (then the least loaded takes it; the same balance guard as a gateway's
``--routing cache``). A gateway that routes by cache itself picks the rank; to one that
does not (one rank, ``--routing load`` or ``round-robin``: it still answers PrefixQuery
from where its requests went), the request goes pinned to the rank holding the prefix.

A gateway that is gone is skipped until its client has a session again; requests
already in flight on it fail with the retryable SessionLost (as with one AsyncClient):
retrying through the pool sends them to a gateway that is up. A gateway that is down at
``connect`` is retried in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from codec import (
    AbortAck,
    HealthReply,
    MultimodalItem,
    RequestOptions,
    RequestOutput,
    SamplingParams,
)

from ._compat import timeout as compat_timeout
from .aio import AsyncClient, RequestStream, curve_hint
from .errors import ClientError, GatewayUnavailable
from .results import CompletionCalls

__all__ = ["GatewayPool", "PoolStream"]

_RETRY_CONNECT_S = 1.0
POOL_POLICIES = ("load", "cache")
_GUARD_RATIO, _GUARD_SLACK = 1.5, 8  # a gateway's --routing cache balance guard
logger = logging.getLogger("engine_gateway.client")


class PoolStream:
    """A request's outputs (as RequestStream); the gateway is picked when iteration
    starts. ``gateway`` is the address it went to."""

    def __init__(
        self,
        pool: GatewayPool,
        request_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ):
        self._pool = pool
        self.request_id = request_id
        self._args = args
        self._kwargs = kwargs
        self._stream: RequestStream | None = None
        self.gateway: str | None = None

    def __aiter__(self) -> PoolStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._stream is None:
            self._stream = await self._pool._start(self)
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()

    def abort_samples(self, indices: Sequence[int]) -> None:
        """As RequestStream.abort_samples."""
        if self._stream is not None:
            self._stream.abort_samples(indices)


class GatewayPool(CompletionCalls):
    """Several gateways as one client; use as ``async with GatewayPool(addresses) as pool``.

    Keyword arguments go to each AsyncClient (``reconnect_timeout_s`` also bounds how
    long a request waits for any gateway to be up).
    """

    def __init__(self, addresses: Sequence[str], *, policy: str = "load", **client_kwargs: Any):
        if not addresses:
            raise ValueError("GatewayPool needs at least one address")
        if policy not in POOL_POLICIES:
            raise ValueError(f"policy must be one of {POOL_POLICIES}, got {policy!r}")
        self.policy = policy
        self._client_kwargs = client_kwargs
        self.clients = [AsyncClient(address, **client_kwargs) for address in addresses]
        self._reconnect_timeout_s = client_kwargs.get("reconnect_timeout_s", 30.0)
        # Requests picked for a gateway whose Generate is not sent yet; the others in
        # flight are the live streams of each gateway's client (no count to leak).
        self._starting: dict[str, int] = {}
        self._owners: dict[str, AsyncClient] = {}  # request id -> its client, while live
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
            async with compat_timeout(timeout):
                while not self.connected:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            await self.aclose()
            keys = self._client_kwargs.get("curve_keys") is not None
            raise GatewayUnavailable(
                f"none of {len(self.clients)} gateways answered within {timeout}s: "
                + ", ".join(c.address for c in self.clients)
                + f" (is a gateway serving there? {curve_hint(keys)})"
            ) from None

    async def _join(self, client: AsyncClient) -> None:
        """Connect ``client``; if its gateway is down or refuses the Hello (full, or
        another protocol version for now), try again every second."""
        index = self.clients.index(client)
        try:
            await client.connect()
            return
        except ClientError as exc:
            logger.warning("gateway %s: %s; retrying every %.0fs", client.address, exc, 1.0)
        while True:
            await asyncio.sleep(_RETRY_CONNECT_S)
            fresh = AsyncClient(client.address, **self._client_kwargs)
            try:
                await fresh.connect()
            except ClientError:
                continue
            self.clients[index] = fresh
            return

    async def aclose(self) -> None:
        """Close every gateway's client (their live requests are aborted)."""
        for task in self._retries:
            task.cancel()
        await asyncio.gather(*self._retries, return_exceptions=True)
        await asyncio.gather(*(c.aclose() for c in self.clients), return_exceptions=True)

    @property
    def connected(self) -> list[str]:
        """Addresses of the gateways with a session now."""
        return [c.address for c in self.clients if c.connected]

    def in_flight(self) -> dict[str, int]:
        """This pool's requests in flight, per gateway address."""
        return {c.address: self._load(c) for c in self.clients}

    def _load(self, client: AsyncClient) -> int:
        return len(client.live_request_ids()) + self._starting.get(client.address, 0)

    async def _start(self, stream: PoolStream) -> RequestStream:
        """Send ``stream``'s Generate to the least-loaded gateway that is up; no other
        request of this pool may be live under its id."""
        request_id = stream.request_id
        owner = self._owners.get(request_id)
        if owner is not None and owner.is_live(request_id):
            raise ValueError(f"request id {request_id!r} is still live in this pool")
        client = await self._pick()
        if self.policy == "cache":
            client = await self._by_cache(stream, client)
        address = client.address
        self._starting[address] = self._starting.get(address, 0) + 1
        try:
            started = client.generate(*stream._args, **stream._kwargs)
            await started.start()
        finally:
            self._starting[address] -= 1
        stream.gateway = address
        self._forget_finished_owners()
        self._owners[request_id] = client
        return started

    def _forget_finished_owners(self) -> None:
        if len(self._owners) > 1024 + 2 * sum(map(self._load, self.clients)):
            self._owners = {r: c for r, c in self._owners.items() if c.is_live(r)}

    async def _pick(self) -> AsyncClient:
        """The connected gateway with the fewest requests in flight (ties rotate)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._reconnect_timeout_s
        while True:
            up = [c for c in self.clients if c.connected]
            if up:
                start = next(self._turn) % len(up)
                rotated = up[start:] + up[:start]
                return min(rotated, key=self._load)
            if loop.time() >= deadline:
                raise GatewayUnavailable(
                    f"none of {len(self.clients)} gateways had a session within"
                    f" {self._reconnect_timeout_s}s"
                )
            await asyncio.sleep(0.01)

    async def _by_cache(self, stream: PoolStream, least_loaded: AsyncClient) -> AsyncClient:
        """The gateway holding most of the prompt (PrefixQuery), within the balance guard;
        pins the rank on a gateway that does not route by cache itself."""
        prompt = stream._args[0]
        options: RequestOptions | None = stream._kwargs.get("options")
        if options is not None and options.data_parallel_rank is not None:
            return least_loaded
        up = [c for c in self.clients if c.connected]
        replies = await asyncio.gather(
            *(c.prefix_query(prompt, options) for c in up), return_exceptions=True
        )
        best, best_tokens, best_rank, best_routing = least_loaded, 0, None, "cache"
        for client, reply in zip(up, replies, strict=True):
            if isinstance(reply, BaseException):
                continue
            known = [(t, r) for r, t in enumerate(reply.matched_tokens) if t is not None]
            tokens, rank = max(known, default=(0, None))
            # Ties go to the less loaded gateway (the first listed always won them).
            if tokens > best_tokens or (
                tokens == best_tokens > 0 and self._load(client) < self._load(best)
            ):
                best, best_tokens, best_rank, best_routing = client, tokens, rank, reply.routing
        if best_tokens == 0:
            return least_loaded
        if self._load(best) > _GUARD_RATIO * self._load(least_loaded) + _GUARD_SLACK:
            return least_loaded
        if best_routing != "cache" and best_rank is not None:
            pinned = msgspec.structs.replace(
                options or RequestOptions(), data_parallel_rank=best_rank
            )
            stream._kwargs = {**stream._kwargs, "options": pinned}
        return best

    # ------------------------------------------------------------ requests

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        stream: bool = True,
        request_id: str | None = None,
        options: RequestOptions | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
    ) -> PoolStream:
        """As AsyncClient.generate, on the least-loaded gateway that is up."""
        request_id = request_id or f"p{self._prefix}-{next(self._request_ids)}"
        kwargs = dict(stream=stream, request_id=request_id, options=options)
        if multimodal:
            kwargs["multimodal"] = multimodal
        return PoolStream(self, request_id, (prompt_token_ids, sampling), kwargs)

    async def abort(self, request_ids: Sequence[str] | None = None) -> list[AbortAck]:
        """Abort some (None: all) of this pool's requests, on whichever gateway runs them;
        one AbortAck per gateway that did. A gateway without a session is skipped: its
        requests ended with SessionLost already. Raises what a gateway refused (after the
        others' aborts were carried out)."""
        if request_ids is None:
            calls = {c: None for c in self.clients if c.connected}
        else:
            calls = {}
            for request_id in request_ids:
                owner = self._owners.get(request_id)
                if owner is not None and owner.is_live(request_id):
                    calls.setdefault(owner, []).append(request_id)
        results = await asyncio.gather(
            *(c.abort(ids) for c, ids in calls.items()), return_exceptions=True
        )
        refused = [
            r
            for r in results
            if isinstance(r, BaseException) and not isinstance(r, GatewayUnavailable)
        ]
        if refused:
            raise refused[0]
        return [r for r in results if isinstance(r, AbortAck)]

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
