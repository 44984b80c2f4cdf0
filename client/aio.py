"""AsyncClient: many concurrent requests over one DEALER socket to a gateway.

Rules: one reader task owns the socket's inbound side and routes each frame
to the request or call waiting for it; a heartbeat task pings at the agreed
interval and fails everything waiting when the gateway stays silent past the
agreed timeout. Leaving a ``generate`` loop early, or cancelling the task that
runs it, sends an Abort for that request. Depends on pyzmq and msgspec only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from codec import (
    PROTOCOL_VERSION,
    VERSION_FRAME,
    Abort,
    AbortAck,
    Error,
    ErrorCode,
    Generate,
    GetHealth,
    GetModelInfo,
    HealthReply,
    Hello,
    HelloAck,
    ModelInfoReply,
    Outputs,
    Overloaded,
    Ping,
    Pong,
    ProtocolError,
    RequestOptions,
    RequestOutput,
    SamplingParams,
    decode_server,
    encode_payload,
)

from .errors import GatewayUnavailable, RequestFailed, RequestOverloaded
from .results import Accumulator, Completion

__all__ = ["AsyncClient"]

logger = logging.getLogger("engine_gateway.client")
_YIELD_EVERY = 32  # frames read before the reader lets other tasks run


class _Stream:
    """Inbound items of one live request: RequestOutputs, then maybe an exception."""

    __slots__ = ("items", "wakeup", "samples_left", "abandoned")

    def __init__(self, n: int):
        self.items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self.wakeup = asyncio.Event()
        self.samples_left = n
        self.abandoned = False  # the consumer left; drop items until the terminal

    def push(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        self.wakeup.set()


class AsyncClient:
    """Connects to a gateway; use as ``async with AsyncClient(address) as client``."""

    def __init__(
        self,
        address: str,
        *,
        name: str = "",
        heartbeat_interval_s: float = 1.0,
        identity: bytes | None = None,
        connect_timeout_s: float = 60.0,
        context: zmq.asyncio.Context | None = None,
        curve_keys: tuple[bytes, bytes, bytes] | None = None,
    ):
        """``curve_keys``: (server public, client public, client secret) Z85 keys."""
        self.address = address
        self.name = name
        self.identity = identity or b"c-" + os.urandom(8).hex().encode()
        self._heartbeat_wanted = heartbeat_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._ctx = context or zmq.asyncio.Context.instance()
        self._curve_keys = curve_keys
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[str, _Stream] = {}
        self._abort_waiters: collections.deque[asyncio.Future[AbortAck] | None] = (
            collections.deque()
        )
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._pongs: dict[int, asyncio.Future[Pong]] = {}
        self._call_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._hello: asyncio.Future[HelloAck] | None = None
        self._last_heard = 0.0
        self._closed = False
        self._failure: BaseException | None = None
        self.hello_ack: HelloAck | None = None
        self.connection_errors: list[Error] = []

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def connect(self) -> HelloAck:
        """Open the socket, send Hello and wait for the HelloAck."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve_keys is not None:
            server_public, public, secret = self._curve_keys
            sock.curve_serverkey = server_public
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        sock.connect(self.address)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._hello = loop.create_future()
        self._last_heard = time.monotonic()
        self._tasks.append(loop.create_task(self._reader(), name="gateway-client-reader"))
        self._send(Hello(PROTOCOL_VERSION, self.name, self._heartbeat_wanted))
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                ack = await self._hello
        except TimeoutError:
            await self.aclose()
            raise GatewayUnavailable(
                f"no HelloAck from {self.address} within {self._connect_timeout_s}s"
            ) from None
        except BaseException:
            await self.aclose()
            raise
        self.hello_ack = ack
        self._tasks.append(loop.create_task(self._heartbeat(ack), name="gateway-client-heartbeat"))
        return ack

    async def aclose(self) -> None:
        """Abort this client's live requests, stop the tasks and close the socket."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None and self._streams and self.hello_ack is not None:
            self._send(Abort(None))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(GatewayUnavailable("client closed"))
        if self._sock is not None:
            self._sock.close(linger=100)

    # ------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return f"r{next(self._request_ids)}"

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        stream: bool = True,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs as they arrive, ending after the last terminal.

        Raises:
            RequestFailed: the gateway refused or failed the request (Error frame).
            RequestOverloaded: admission control refused it.
            GatewayUnavailable: the gateway went silent, or the client closed.
        """
        sampling = sampling or SamplingParams()
        request_id = request_id or self.new_request_id()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is still live on this client")
        self._check_open()
        stream_state = _Stream(sampling.n if sampling.n and sampling.n > 0 else 1)
        self._streams[request_id] = stream_state
        finished = False
        try:
            self._send(Generate(request_id, list(prompt_token_ids), stream, sampling, options))
            while True:
                while not stream_state.items:
                    stream_state.wakeup.clear()
                    await stream_state.wakeup.wait()
                item = stream_state.items.popleft()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished is not None:
                    stream_state.samples_left -= 1
                    if stream_state.samples_left <= 0:
                        finished = True
                        yield item
                        return
                yield item
        finally:
            if finished or self._closed:
                self._streams.pop(request_id, None)
            else:
                # Left early (break, cancellation, exception): abort it, and keep
                # the id reserved until its terminal output arrives.
                stream_state.abandoned = True
                stream_state.items.clear()
                self._abort_waiters.append(None)
                self._send(Abort([request_id]))

    async def complete_samples(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> list[Completion]:
        """Run a non-streaming request; one Completion per sample, by index."""
        acc = Accumulator()
        async for out in self.generate(
            prompt_token_ids, sampling, stream=False, request_id=request_id, options=options
        ):
            acc.add(out)
        return [acc.done[i] for i in sorted(acc.done)]

    async def complete(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> Completion:
        """Run a non-streaming single-sample request and return its Completion."""
        if sampling is not None and sampling.n not in (None, 1):
            raise ValueError("complete() is for n=1; use complete_samples() for n>1")
        (completion,) = await self.complete_samples(
            prompt_token_ids, sampling, request_id=request_id, options=options
        )
        return completion

    async def abort(self, request_ids: Sequence[str] | None = None) -> AbortAck:
        """Abort some (or, with None, all) of this client's requests; wait for the ack."""
        self._check_open()
        future: asyncio.Future[AbortAck] = asyncio.get_running_loop().create_future()
        self._abort_waiters.append(future)
        self._send(Abort(None if request_ids is None else list(request_ids)))
        return await future

    async def ping(self) -> float:
        """Round trip to the gateway, in seconds."""
        self._check_open()
        nonce = next(self._call_ids)
        future: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = future
        start = time.perf_counter()
        self._send(Ping(nonce))
        await future
        return time.perf_counter() - start

    async def model_info(self) -> ModelInfoReply:
        return await self._call(GetModelInfo)

    async def health(self) -> HealthReply:
        return await self._call(GetHealth)

    async def _call(self, message_type: type) -> Any:
        self._check_open()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(message_type(call_id))
        return await future

    # ------------------------------------------------------------ plumbing

    def _check_open(self) -> None:
        if self._closed or self._sock is None:
            raise GatewayUnavailable("client is closed")
        if self._failure is not None:
            raise self._failure

    def _send(self, msg: Any) -> None:
        assert self._sock is not None
        self._sock.send_multipart([VERSION_FRAME, encode_payload(msg)])

    async def _reader(self) -> None:
        sock = self._sock
        assert sock is not None
        received = 0
        while True:
            frames = await sock.recv_multipart()
            self._last_heard = time.monotonic()
            received += 1
            if received % _YIELD_EVERY == 0:
                # Awaiting an already-received frame does not yield: under a steady
                # stream this loop would starve the consumers and the heartbeat.
                await asyncio.sleep(0)
            try:
                msg = decode_server(frames)
            except ProtocolError as exc:
                logger.warning("unreadable frame from gateway: %s", exc)
                continue
            if type(msg) is Outputs:
                self._on_outputs(msg)
            else:
                self._on_reply(msg)

    def _on_outputs(self, msg: Outputs) -> None:
        streams = self._streams
        for out in msg.outputs:
            state = streams.get(out.request_id)
            if state is None:
                continue
            if state.abandoned:
                if out.finished is not None:
                    state.samples_left -= 1
                    if state.samples_left <= 0:
                        del streams[out.request_id]
                continue
            state.push(out)

    def _on_reply(self, msg: Any) -> None:
        kind = type(msg)
        if kind is Error:
            self._on_error(msg)
        elif kind is Overloaded:
            self._end_stream(
                msg.request_id,
                RequestOverloaded(
                    msg.request_id, msg.limit, msg.limit_value, msg.current, msg.message
                ),
            )
        elif kind is AbortAck:
            waiter = self._abort_waiters.popleft() if self._abort_waiters else None
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif kind is Pong:
            future = self._pongs.pop(msg.nonce, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif kind is HelloAck:
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(msg)
        elif kind in (ModelInfoReply, HealthReply):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                future.set_result(msg)

    def _on_error(self, msg: Error) -> None:
        exc = RequestFailed(msg.request_id, msg.code, msg.message)
        # DUPLICATE_REQUEST_ID refers to a refused new Generate, not to the live request.
        if (
            msg.request_id is not None
            and msg.request_id in self._streams
            and msg.code is not ErrorCode.DUPLICATE_REQUEST_ID
        ):
            self._end_stream(msg.request_id, exc)
            return
        self.connection_errors.append(msg)
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(exc)
        else:
            logger.warning("gateway error: %s", exc)

    def _end_stream(self, request_id: str, exc: BaseException) -> None:
        state = self._streams.get(request_id)
        if state is None:
            return
        if state.abandoned:
            del self._streams[request_id]
        else:
            state.push(exc)

    async def _heartbeat(self, ack: HelloAck) -> None:
        interval = ack.heartbeat_interval_s
        timeout = ack.heartbeat_timeout_s
        nonces = itertools.count(1 << 62)
        while True:
            await asyncio.sleep(interval)
            self._send(Ping(next(nonces)))
            if time.monotonic() - self._last_heard > timeout:
                self._fail_all(
                    GatewayUnavailable(
                        f"gateway at {self.address} silent for more than {timeout:.1f}s"
                    )
                )

    def _fail_all(self, exc: GatewayUnavailable) -> None:
        self._failure = exc
        for request_id in list(self._streams):
            self._end_stream(request_id, exc)
        for future in [*self._calls.values(), *self._pongs.values(), *self._abort_waiters]:
            if future is not None and not future.done():
                future.set_exception(exc)
        self._calls.clear()
        self._pongs.clear()
        self._abort_waiters.clear()
