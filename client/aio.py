"""AsyncClient: many concurrent requests over one DEALER socket to a gateway.

Rules: the event loop watches the socket's file descriptor; its callback reads
every frame waiting and routes each to the request or call waiting for it (no
reader task: a frame reaches its consumer one loop pass after it arrives). A
keeper task holds the session: it pings at the agreed interval, and when the
gateway stays silent past the agreed timeout (or says it no longer knows this
client) it fails everything in flight with the retryable SessionLost and says
Hello again, with backoff, until a gateway answers. Calls made meanwhile wait
for the new session up to ``reconnect_timeout_s``. Leaving a ``generate`` loop
early, cancelling the task that runs it, or dropping its stream sends an Abort
for that request.
Depends on pyzmq and msgspec only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from codec import (
    PROTOCOL_VERSION,
    VERSION_FRAME,
    AbandonWeightUpdate,
    Abort,
    AbortAck,
    AbortSamples,
    ControlDone,
    Error,
    ErrorCode,
    FinishWeightUpdate,
    Generate,
    GetHealth,
    GetModelInfo,
    GetStats,
    Goodbye,
    HealthReply,
    Hello,
    HelloAck,
    InitWeightTransfer,
    ListLoras,
    LoadLora,
    Logprobs,
    ModelInfoReply,
    MultimodalItem,
    Outputs,
    Overloaded,
    Pause,
    Ping,
    Pong,
    PrefixQuery,
    PrefixReply,
    ProtocolError,
    ReloadWeights,
    RequestOptions,
    RequestOutput,
    ResetPrefixCache,
    Resume,
    SamplingParams,
    SetWeightVersion,
    ShutdownWeightTransfer,
    Sleep,
    StartWeightUpdate,
    StatsReply,
    UnloadLora,
    UpdateWeights,
    WakeUp,
    decode_server,
    encode_payload,
)

from ._compat import timeout
from .errors import (
    ClientError,
    GatewayUnavailable,
    RequestFailed,
    RequestOverloaded,
    SessionLost,
)
from .results import CompletionCalls

_SCHEMES = ("tcp://", "ipc://", "inproc://")  # what ZeroMQ connects a DEALER to

__all__ = ["AsyncClient", "RequestStream"]

logger = logging.getLogger("engine_gateway.client")
_RECONNECT_BACKOFF_S = (0.05, 2.0)  # first and largest pause between Hellos
_PAUSE_S = 0.25  # the keeper waking this late means this process itself did not run
_KEPT_CONNECTION_ERRORS = 64
_READ_BATCH = 32  # frames read in one callback before the woken consumers get to run
# ZMQ_EVENTS masks as ints: `int & zmq.POLLIN` builds a flag enum (~0.85 µs on Python 3.11,
# against ~0.02 µs for two ints), twice per frame read.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_MAX_REMEMBERED_HASHES = 100_000  # multimodal hashes sent in this session, before forgetting
_MAX_PENDING_OUTPUTS = 64  # per request; past it, a sample's new outputs merge into its last
# Errors that mean the gateway no longer holds a session for this client.
_SESSION_GONE = (ErrorCode.HANDSHAKE_REQUIRED, ErrorCode.SLOW_CONSUMER, ErrorCode.SESSION_EXPIRED)
# Of those, the ones that end a request or call as SessionLost (retryable): never accepted,
# or ended because the session expired.
_RETRY_IN_NEW_SESSION = (ErrorCode.HANDSHAKE_REQUIRED, ErrorCode.SESSION_EXPIRED)


def _merge(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output holding ``first`` then ``then`` (same request and sample)."""
    return RequestOutput(
        first.request_id,
        first.new_token_ids + then.new_token_ids,
        then.finished,
        Logprobs.concat(first.logprobs, then.logprobs),
        Logprobs.concat(first.prompt_logprobs, then.prompt_logprobs),
        first.index,
        first.weight_version,  # push() merges only outputs whose version did not change
    )


class _Slot:
    __slots__ = ("item",)

    def __init__(self, item: RequestOutput | BaseException):
        self.item = item


class _Stream:
    """Inbound items of one live request: RequestOutputs, then maybe an exception.

    Bounded: once ``_MAX_PENDING_OUTPUTS`` items wait, an output for a sample
    whose last output is still unconsumed is merged into it (as vLLM's
    RequestOutputCollector merges deltas), so a consumer that lags holds at
    most that many items plus one per sample, whatever the request's length.
    """

    __slots__ = ("items", "open", "wakeup", "samples_left", "abandoned", "resend")

    def __init__(self, n: int):
        self.items: collections.deque[_Slot] = collections.deque()
        self.open: dict[int, _Slot] = {}  # sample index -> its last unconsumed, unfinished output
        self.wakeup = asyncio.Event()
        self.samples_left = n
        self.abandoned = False  # the consumer left; drop items until the terminal
        # The Generate with every item's tensors, when it went out with some left out
        # (the gateway held them): sent once more if the gateway no longer holds one.
        self.resend: Generate | None = None

    def push(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            slot = self.open.get(item.index)
            if (
                slot is not None
                and len(self.items) >= _MAX_PENDING_OUTPUTS
                and item.weight_version is None
            ):
                slot.item = _merge(slot.item, item)  # type: ignore[arg-type]
                if item.finished is not None:
                    del self.open[item.index]
                return
            slot = _Slot(item)
            if item.finished is None:
                self.open[item.index] = slot
            else:
                self.open.pop(item.index, None)
        else:
            slot = _Slot(item)
        self.items.append(slot)
        self.wakeup.set()

    async def next(self) -> RequestOutput | BaseException:
        while not self.items:
            self.wakeup.clear()
            await self.wakeup.wait()
        slot = self.items.popleft()
        item = slot.item
        if isinstance(item, RequestOutput) and self.open.get(item.index) is slot:
            del self.open[item.index]
        return item


class RequestStream:
    """The outputs of one request, as an async iterator (what ``generate`` returns).

    The Generate is sent when iteration starts. It ends after the request's
    last terminal output, or raises the request's error. ``aclose()``, leaving
    an ``async for`` early, cancelling the task iterating it, or dropping the
    stream unfinished sends an Abort; the id stays reserved until its terminal.
    """

    def __init__(self, client: AsyncClient, message: Generate, n: int):
        self.request_id = message.request_id
        self._client = client
        self._message = message
        self._state = _Stream(n)
        self._started = False
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def start(self) -> None:
        """Send the Generate now, if iteration has not sent it yet (raises as iteration)."""
        if not self._started and not self._done:
            try:
                await self._client._start_request(self._message, self._state)
            except BaseException:
                self._done = True
                raise
            self._started = True

    @property
    def live(self) -> bool:
        """Sent and not ended (nor aborted by its consumer)."""
        return self._started and not self._done

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        state = self._state
        try:
            if not self._started:
                await self._client._start_request(self._message, state)
                self._started = True
            item = await state.next()
        except BaseException:
            if self._started:
                self._abandon()
            else:
                self._done = True
            raise
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished is not None:
            state.samples_left -= 1
            if state.samples_left <= 0:
                self._finish()
        return item

    async def aclose(self) -> None:
        """Stop the request: abort it if it is still running."""
        if self._started:
            self._abandon()
        self._done = True

    def abort_samples(self, indices: Sequence[int]) -> None:
        """Abort some samples of this live request (n > 1); the others run on. Each that
        was still running gets its terminal output (ABORT) in this stream."""
        if self.live and indices:
            self._client._abort_samples(self.request_id, self._state, list(indices))

    def _finish(self) -> None:
        self._done = True
        streams = self._client._streams
        if streams.get(self.request_id) is self._state:
            del streams[self.request_id]

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            self._client._abandon(self.request_id, self._state)

    def __del__(self) -> None:
        if self._started and not self._done:
            client = self._client
            with contextlib.suppress(RuntimeError, AttributeError):  # loop closed
                client._loop.call_soon_threadsafe(client._abandon, self.request_id, self._state)


class AsyncClient(CompletionCalls):
    """Connects to a gateway; use as ``async with AsyncClient(address) as client``."""

    def __init__(
        self,
        address: str,
        *,
        name: str = "",
        heartbeat_interval_s: float = 1.0,
        identity: bytes | None = None,
        connect_timeout_s: float = 60.0,
        reconnect_timeout_s: float = 30.0,
        context: zmq.Context | None = None,
        curve_keys: tuple[bytes, bytes, bytes] | None = None,
        call_timeout_s: float | None = 300.0,
    ):
        """``curve_keys``: (server public, client public, client secret) Z85 keys.

        ``reconnect_timeout_s``: how long a call made while the session is down
        waits for the client to open a new one before GatewayUnavailable (0: at once).
        ``call_timeout_s``: how long a control call (pause, weights, LoRA, stats, a
        PrefixQuery, ...) waits for its answer before TimeoutError (None: for ever; a
        ReloadWeights of a very large checkpoint may need more). The gateway may still
        carry the call out; a lost session fails it at once with SessionLost.
        """
        if not isinstance(address, str) or not address.startswith(_SCHEMES):
            raise ValueError(
                f"a gateway address is tcp://HOST:PORT or ipc://PATH (e.g."
                f" tcp://127.0.0.1:5557), got {address!r}"
            )
        self.address = address
        self.name = name
        self.identity = identity or b"c-" + os.urandom(8).hex().encode()
        self._heartbeat_wanted = heartbeat_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._reconnect_timeout_s = reconnect_timeout_s
        self._call_timeout_s = call_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._curve_keys = curve_keys
        self._sock: zmq.Socket | None = None
        self._outbox: collections.deque[list[bytes]] = collections.deque()  # sends that waited
        self._events_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self._abort_waiters: dict[int, asyncio.Future[AbortAck]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._pongs: dict[int, asyncio.Future[Pong]] = {}
        self._call_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._session: asyncio.Event | None = None  # set while a session is open
        self._first_session: asyncio.Future[HelloAck] | None = None
        self._last_heard = 0.0
        self._closed = False
        self.hello_ack: HelloAck | None = None
        # Hashes of multimodal items sent with tensors in this session: later requests
        # name them by hash alone (the gateway holds them; PROTOCOL.md §7.16).
        self._multimodal_sent: set[str] = set()
        self.multimodal_resends = 0
        self.sessions_opened = 0
        self.connection_errors: collections.deque[Error] = collections.deque(
            maxlen=_KEPT_CONNECTION_ERRORS
        )

    # ------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def connect(self) -> HelloAck:
        """Open the socket and the first session (Hello, HelloAck)."""
        # A plain socket: the loop watches its FD (_on_socket_events), not pyzmq's
        # asyncio layer, whose Future per frame and reader task cost a loop pass each.
        sock = zmq.Socket(self._ctx, zmq.DEALER)
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
        self._loop = loop
        self._session = asyncio.Event()
        self._lost = asyncio.Event()  # set while the session is lost, for the keeper
        self._first_session = loop.create_future()
        self._last_heard = time.monotonic()
        loop.add_reader(sock.FD, self._on_socket_events)
        self._send(Hello(PROTOCOL_VERSION, self.name, self._heartbeat_wanted))
        try:
            async with timeout(self._connect_timeout_s):
                ack = await self._first_session
        except TimeoutError:
            await self.aclose()
            cause = curve_hint(self._curve_keys is not None)
            raise GatewayUnavailable(
                f"no HelloAck from {self.address} within {self._connect_timeout_s:g}s"
                f" (connect_timeout_s): is a gateway serving there? {cause}"
            ) from None
        except BaseException:
            await self.aclose()
            raise
        self._tasks.append(loop.create_task(self._keeper(), name="gateway-client-keeper"))
        return ack

    async def aclose(self) -> None:
        """Abort this client's live requests, stop the tasks and close the socket."""
        if self._closed:
            return
        if self._sock is not None and self.connected:
            # Goodbye first: the session ends now, not when its heartbeat lapses. Were the
            # Abort first, its answers could reach a socket already closed, and the gateway
            # would end the session as unreachable before it read the Goodbye.
            self._send(Goodbye())
            if self._streams:
                self._send(Abort(None))  # (a gateway older than Goodbye ends them so)
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(GatewayUnavailable("client closed"))
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.FD)
            self._sock.close(linger=100)

    @property
    def connected(self) -> bool:
        """Whether a session with the gateway is open now."""
        return self._session is not None and self._session.is_set() and not self._closed

    def live_request_ids(self) -> set[str]:
        """Request ids still live on this client (sent, no terminal yet; aborted ones until
        their terminal arrives): its load on the gateway."""
        return set(self._streams)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._streams

    # ------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return f"r{next(self._request_ids)}"

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        stream: bool = True,
        request_id: str | None = None,
        options: RequestOptions | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
    ) -> RequestStream:
        """Stream the request's RequestOutputs as they arrive: ``async for out in ...``.

        ``multimodal``: processed items, each with its tensors
        (``client.multimodal_processor`` makes them); an item whose hash this session
        already sent goes by hash alone, and is sent again in full if the gateway no
        longer holds it.

        Iteration raises:
            RequestFailed: the gateway refused or failed the request (Error frame).
            RequestOverloaded: admission control refused it.
            SessionLost: the session ended while it ran (retryable).
            GatewayUnavailable: no session within ``reconnect_timeout_s``, or closed.
        """
        sampling = sampling or SamplingParams()
        request_id = request_id or self.new_request_id()
        self._check_open()
        items = list(multimodal) if multimodal else None
        message = Generate(request_id, list(prompt_token_ids), stream, sampling, options, items)
        return RequestStream(self, message, sampling.n if sampling.n and sampling.n > 0 else 1)

    async def _start_request(self, message: Generate, state: _Stream) -> None:
        await self._wait_session()
        if message.request_id in self._streams:
            raise ValueError(f"request id {message.request_id!r} is still live on this client")
        sent = self._by_hash(message) if message.multimodal else message
        payload = self._encode_within_limit(sent, message.request_id)
        self._streams[message.request_id] = state
        state.resend = message if sent is not message else None
        self._send_payload(payload)

    def _by_hash(self, message: Generate) -> Generate:
        """``message`` with the tensors of items this session already sent (or this request
        sends earlier) left out; the rest are remembered as sent."""
        known = self._multimodal_sent
        if len(known) > _MAX_REMEMBERED_HASHES:
            known.clear()
        items = []
        for item in message.multimodal or ():
            if item.tensors is not None and item.hash in known:
                item = msgspec.structs.replace(item, tensors=None)
            elif item.tensors is not None:
                known.add(item.hash)  # a repeat later in this request goes by hash too
            items.append(item)
        if all(a is b for a, b in zip(items, message.multimodal or (), strict=True)):
            return message
        return msgspec.structs.replace(message, multimodal=items)

    def _abandon(self, request_id: str, state: _Stream) -> None:
        """The consumer left a live request: abort it; keep its id until the terminal."""
        if self._streams.get(request_id) is not state:
            return  # already ended (or its id reused after the terminal)
        state.abandoned = True
        state.items.clear()
        state.open.clear()
        if self.connected:
            self._send(Abort([request_id]))  # call_id 0: nobody waits for this ack
        else:
            del self._streams[request_id]

    def _abort_samples(self, request_id: str, state: _Stream, indices: list[int]) -> None:
        if self._streams.get(request_id) is state and self.connected:
            self._send(AbortSamples(request_id, indices))  # call_id 0: nobody waits

    async def abort(self, request_ids: Sequence[str] | None = None) -> AbortAck:
        """Abort some (or, with None, all) of this client's requests; wait for the ack.

        Raises RequestFailed when the gateway refuses the Abort itself (too many ids).
        """
        await self._wait_session()
        call_id = next(self._call_ids)
        payload = self._encode_within_limit(
            Abort(None if request_ids is None else list(request_ids), call_id)
        )
        future: asyncio.Future[AbortAck] = asyncio.get_running_loop().create_future()
        self._abort_waiters[call_id] = future
        self._send_payload(payload)
        return await future

    async def ping(self) -> float:
        """Round trip to the gateway, in seconds.

        Raises GatewayUnavailable when no session opens within ``reconnect_timeout_s``,
        SessionLost when the session ends meanwhile, TimeoutError after the heartbeat
        timeout without an answer."""
        await self._wait_session()
        nonce = next(self._call_ids)
        future: asyncio.Future[Pong] = asyncio.get_running_loop().create_future()
        self._pongs[nonce] = future
        start = time.perf_counter()
        self._send(Ping(nonce))
        ack = self.hello_ack
        # Past the keeper's own silence check (which fails it with SessionLost first).
        wait_s = ack.heartbeat_timeout_s + 2 * ack.heartbeat_interval_s if ack else 60.0
        try:
            async with timeout(wait_s):
                await future
        except TimeoutError:
            self._pongs.pop(nonce, None)
            raise TimeoutError(f"no Pong from {self.address} within {wait_s}s") from None
        return time.perf_counter() - start

    async def model_info(self) -> ModelInfoReply:
        return await self._call(GetModelInfo)

    async def health(self) -> HealthReply:
        return await self._call(GetHealth)

    async def prefix_query(
        self, prompt_token_ids: Sequence[int], options: RequestOptions | None = None
    ) -> PrefixReply:
        """Per data-parallel rank, how many of the prompt's leading tokens a request would
        find in that rank's prefix cache (``matched_tokens``; None where the gateway's
        index of that rank is not usable now). Needs cache routing on the gateway (its
        default with two or more ranks) for figures; ``options``: the ``lora_name`` and
        ``cache_salt`` the request would carry (they are part of vLLM's block hash)."""
        return await self._call(PrefixQuery, list(prompt_token_ids), options)

    # ------------------------------------------------------------ control plane
    # Allowed only to clients the operator named (--control-key / --control-open);
    # others get RequestFailed with ErrorCode.UNAUTHORIZED.

    async def pause(self, mode: str = "keep", *, clear_cache: bool = False) -> ControlDone:
        """Pause the engine: "keep" (freeze), "wait" (returns once drained) or "abort"."""
        return await self._call(Pause, mode, clear_cache)

    async def resume(self) -> ControlDone:
        return await self._call(Resume)

    async def reset_prefix_cache(self, *, reset_running: bool = False) -> bool:
        """Reset the engine's prefix cache; vLLM's result (False: it could not)."""
        return (await self._call(ResetPrefixCache, reset_running)).result

    async def reload_weights(self, path: str, *, version: str | None = None) -> ControlDone:
        """Load new weights from ``path`` into the running engine, reset the prefix cache,
        and name the version. Pause (keep) first to stop generation meanwhile."""
        return await self._call(ReloadWeights, path, version)

    async def set_weight_version(self, version: str) -> ControlDone:
        return await self._call(SetWeightVersion, version)

    async def sleep(self, level: int = 1) -> ControlDone:
        """vLLM's sleep (engines with --enable-sleep-mode; else UNSUPPORTED, vLLM's reason)."""
        return await self._call(Sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> ControlDone:
        return await self._call(WakeUp, tags)

    async def load_lora(self, name: str, path: str) -> ControlDone:
        """Load a LoRA adapter; usable at once with RequestOptions(lora_name=name)."""
        return await self._call(LoadLora, name, path)

    async def unload_lora(self, name: str) -> ControlDone:
        return await self._call(UnloadLora, name)

    # ---- weight transfer (vLLM's weight-transfer API; client.weight_sync drives it)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> ControlDone:
        """vLLM's init_weight_transfer_engine on every worker (the backend's init map; the
        ``cpu`` backend takes ``{}`` and answers with ``result["directory"]``, the private
        folder the gateway made for the buffer files)."""
        return await self._call(InitWeightTransfer, init_info)

    async def start_weight_update(self, pause: str | None = None) -> ControlDone:
        """Open a weight update: generation is held until it ends (finish, abandon, or
        failure) with vLLM's pause mode ``pause`` ("keep" when None, "wait", "abort")."""
        return await self._call(StartWeightUpdate, pause)

    async def abandon_weight_update(self) -> ControlDone:
        """End this session's open update where it stands (layers not finished keep their
        old weights; WEIGHTS_INCOMPLETE if some took new ones); its hold on generation ends."""
        return await self._call(AbandonWeightUpdate)

    async def update_weights(self, update_info: dict | list[dict]) -> ControlDone:
        """One chunk of the open update (the backend's update map, or one per worker)."""
        return await self._call(UpdateWeights, update_info)

    async def finish_weight_update(self, weight_version: str | None = None) -> ControlDone:
        """Close the open update; its result: ``{"weight_version", "prefix_cache_reset"}``."""
        return await self._call(FinishWeightUpdate, weight_version)

    async def shutdown_weight_transfer_engine(self) -> ControlDone:
        return await self._call(ShutdownWeightTransfer)

    async def list_loras(self) -> list[str]:
        return (await self._call(ListLoras)).result

    async def stats(self) -> StatsReply:
        """Per-engine load (with --engine-stats) and the gateway's counts."""
        return await self._call(GetStats)

    async def _call(self, message_type: type, *args: Any) -> Any:
        self._check_open()
        await self._wait_session()
        call_id = next(self._call_ids)
        payload = self._encode_within_limit(message_type(call_id, *args))
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send_payload(payload)
        if self._call_timeout_s is None:
            return await future
        try:
            async with timeout(self._call_timeout_s):
                return await asyncio.shield(future)  # the clock must not cancel the answer
        except TimeoutError:
            if future.done():  # answered (or failed) as the clock ran out
                return future.result()
            self._calls.pop(call_id, None)
            raise TimeoutError(
                f"{message_type.__name__} (call_id {call_id}) had no answer from"
                f" {self.address} within call_timeout_s ({self._call_timeout_s}s)"
            ) from None

    def _encode_within_limit(self, msg: Any, request_id: str | None = None) -> bytes:
        """``msg``'s payload; RequestFailed(FRAME_TOO_LARGE) here, without sending it, when
        it exceeds the gateway's ``max_frame_bytes`` (HelloAck)."""
        payload = encode_payload(msg)
        ack = self.hello_ack
        if ack is not None and len(payload) > ack.limits.max_frame_bytes:
            raise RequestFailed(
                request_id,
                ErrorCode.FRAME_TOO_LARGE,
                f"{type(msg).__name__} of {len(payload)} bytes exceeds the gateway's"
                f" max_frame_bytes ({ack.limits.max_frame_bytes}); not sent",
            )
        return payload

    # ------------------------------------------------------------ session

    def _check_open(self) -> None:
        if self._closed or self._sock is None:
            raise GatewayUnavailable("client is closed")

    async def _wait_session(self) -> None:
        self._check_open()
        session = self._session
        assert session is not None
        if session.is_set():
            return
        try:
            async with timeout(self._reconnect_timeout_s):
                await session.wait()
        except TimeoutError:
            raise GatewayUnavailable(
                f"no session with the gateway at {self.address} within"
                f" {self._reconnect_timeout_s}s (it is being re-opened)"
            ) from None
        self._check_open()

    def _on_session_lost(self, why: str, fail_in_flight: bool = True) -> None:
        """The gateway holds no session for us: the keeper says Hello again.

        Everything in flight fails with SessionLost, unless the gateway still
        sends each request its own terminal Error (``fail_in_flight`` off).
        """
        session = self._session
        if session is None or not session.is_set():
            return
        logger.warning("session with %s lost: %s; reconnecting", self.address, why)
        session.clear()
        self._lost.set()
        if fail_in_flight:
            self._fail_all(SessionLost(f"session with the gateway at {self.address} lost: {why}"))

    async def _keeper(self) -> None:
        """Heartbeats while a session is open; Hello with backoff while it is not."""
        session = self._session
        assert session is not None
        nonces = itertools.count(1 << 62)
        backoff = _RECONNECT_BACKOFF_S[0]
        while True:
            ack = self.hello_ack
            assert ack is not None
            if session.is_set():
                backoff = _RECONNECT_BACKOFF_S[0]
                due = time.monotonic() + ack.heartbeat_interval_s
                lost = self._lost
                with contextlib.suppress(TimeoutError):
                    async with timeout(ack.heartbeat_interval_s):
                        await lost.wait()  # a loss seen meanwhile: say Hello at once
                if lost.is_set():
                    continue
                self._send(Ping(next(nonces)))
                now = time.monotonic()
                if now - due > _PAUSE_S:
                    # This process did not run (host paused, CPU-throttled, loop held):
                    # what the gateway sent meanwhile waits unread; not its silence.
                    self._last_heard = min(self._last_heard + now - due, now)
                silent = now - self._last_heard
                if silent > ack.heartbeat_timeout_s:
                    self._on_session_lost(f"gateway silent for {silent:.1f}s")
                continue
            self._send(Hello(PROTOCOL_VERSION, self.name, self._heartbeat_wanted))
            with contextlib.suppress(TimeoutError):
                async with timeout(backoff):
                    await session.wait()
            backoff = min(backoff * 2, _RECONNECT_BACKOFF_S[1])

    # ------------------------------------------------------------ plumbing

    def _send(self, msg: Any) -> None:
        self._send_payload(encode_payload(msg))

    def _send_payload(self, payload: bytes) -> None:
        sock = self._sock
        assert sock is not None
        frames = [VERSION_FRAME, payload]
        if self._outbox:  # keep order behind the sends still waiting
            self._outbox.append(frames)
            return
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:  # the gateway is not reading (send high-water mark): keep it
            self._outbox.append(frames)
        except zmq.ZMQError as exc:  # socket closed: the session logic reports it
            logger.debug("send to gateway failed: %s", exc)
            return
        # A send also consumes the FD's edge (ZeroMQ's FD is edge-triggered): look at the
        # socket's events once more, soon, so a frame that arrived meanwhile is read.
        self._schedule_socket_events()

    def _schedule_socket_events(self) -> None:
        if not self._events_scheduled and self._loop is not None:
            self._events_scheduled = True
            self._loop.call_soon(self._on_socket_events)

    def _on_socket_events(self) -> None:
        """The socket's FD fired (or a send may have hidden its edge): receive every
        frame waiting, up to _READ_BATCH before letting the consumers run, and send
        what waited for room."""
        self._events_scheduled = False
        sock = self._sock
        if sock is None or sock.closed:
            return
        received = 0
        try:
            while True:
                events = sock.get(zmq.EVENTS)
                if events & _POLLOUT and self._outbox:
                    self._flush_outbox(sock)
                    self._schedule_socket_events()  # the sends may have hidden the edge
                if not events & _POLLIN:
                    return
                if received == _READ_BATCH:
                    # More waiting: read on after the woken consumers (and the
                    # heartbeat) ran, so a flood cannot starve them.
                    self._schedule_socket_events()
                    return
                frames = sock.recv_multipart(zmq.NOBLOCK)
                received += 1
                self._last_heard = time.monotonic()
                try:
                    self._on_frames(frames)
                except Exception:  # a bug: keep reading, or the edge would be lost
                    logger.exception("handling a frame from the gateway failed")
        except zmq.ZMQError as exc:  # closed under us: aclose is under way
            logger.debug("gateway socket: %s", exc)

    def _flush_outbox(self, sock: zmq.Socket) -> None:
        outbox = self._outbox
        while outbox:
            try:
                sock.send_multipart(outbox[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            outbox.popleft()

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            msg = decode_server(frames)
        except ProtocolError as exc:
            # A newer gateway's message this client does not know: ignore it.
            level = logging.DEBUG if exc.code is ErrorCode.UNKNOWN_MESSAGE else logging.WARNING
            logger.log(level, "unreadable frame from gateway: %s", exc)
            return
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
            exc = RequestOverloaded(
                msg.request_id, msg.limit, msg.limit_value, msg.current, msg.message
            )
            if msg.limit == "max_clients" and not self.connected:
                self._on_hello_refused(exc)
            else:
                self._end_stream(msg.request_id, exc)
        elif kind is AbortAck:
            waiter = self._abort_waiters.pop(msg.call_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif kind is Pong:
            self._check_session_id(msg.session_id)
            future = self._pongs.pop(msg.nonce, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif kind is HelloAck:
            self._on_hello_ack(msg)
        elif kind in (ModelInfoReply, HealthReply, ControlDone, StatsReply, PrefixReply):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                future.set_result(msg)

    def _on_hello_ack(self, ack: HelloAck) -> None:
        session = self._session
        assert session is not None
        if session.is_set():
            return  # an answer to a Hello sent twice while reconnecting
        self.hello_ack = ack
        self._multimodal_sent.clear()  # a new session holds no items
        self.sessions_opened += 1
        self._last_heard = time.monotonic()
        self._lost.clear()
        session.set()
        if self._first_session is not None and not self._first_session.done():
            self._first_session.set_result(ack)

    def _check_session_id(self, session_id: int) -> None:
        """A Pong says which session the gateway holds for us (0: none). Another than ours
        means the gateway ended ours without telling us (a reset connection, a restart, an
        expiry we did not read): what is in flight will never end there."""
        ack = self.hello_ack
        if ack is None or not ack.session_id or not self.connected:
            return  # a gateway that reports no session ids, or between sessions
        if session_id != ack.session_id:
            self._on_session_lost(
                "the gateway holds no session for this client any more"
                if session_id == 0
                else "the gateway holds another session for this client"
            )

    def _on_hello_refused(self, exc: BaseException) -> None:
        """The first Hello was refused: connect() raises it; later ones are retried."""
        if self._first_session is not None and not self._first_session.done():
            self._first_session.set_exception(exc)
        else:
            logger.warning("Hello refused while reconnecting: %s", exc)

    def _on_error(self, msg: Error) -> None:
        if msg.code is ErrorCode.MULTIMODAL_ITEM_UNKNOWN and self._resend_in_full(msg):
            return
        exc: ClientError = RequestFailed(msg.request_id, msg.code, msg.message)
        session_gone = msg.code in _SESSION_GONE
        why = f"[{msg.code.name}] {msg.message}"
        waiter = self._abort_waiters.pop(msg.call_id, None) if msg.call_id else None
        call = self._calls.pop(msg.call_id, None) if msg.call_id else None
        if msg.code in _RETRY_IN_NEW_SESSION and (waiter is not None or call is not None):
            # The call reached a gateway that holds no session for us: retry it in the next.
            exc = SessionLost(f"the gateway holds no session for this client: {msg.message}")
        if waiter is not None:
            if not waiter.done():
                waiter.set_exception(exc)
        elif call is not None:  # a refused or failed call (e.g. UNAUTHORIZED control)
            if not call.done():
                call.set_exception(exc)
        elif (
            msg.request_id is not None
            and msg.request_id in self._streams
            # DUPLICATE_REQUEST_ID refers to a refused new Generate, not to the live one.
            and msg.code is not ErrorCode.DUPLICATE_REQUEST_ID
        ):
            if msg.code is ErrorCode.HANDSHAKE_REQUIRED:
                # The gateway no longer knows this client (it restarted, or the session
                # expired): the request was never accepted, and a retry is safe.
                exc = SessionLost(
                    f"request {msg.request_id!r} reached a gateway that holds no session"
                    f" for this client: {msg.message}"
                )
            elif msg.code is ErrorCode.SESSION_EXPIRED:
                exc = SessionLost(f"request {msg.request_id!r} ended: {msg.message}")
            self._end_stream(msg.request_id, exc)
        else:
            self.connection_errors.append(msg)
            if (
                msg.code in (ErrorCode.UNSUPPORTED_VERSION, ErrorCode.UNAUTHORIZED)
                and not self.connected
            ):
                self._on_hello_refused(exc)
            elif not session_gone:
                logger.warning("gateway error: %s", exc)
        if session_gone:
            # After SLOW_CONSUMER and SESSION_EXPIRED each live request gets its own Error.
            self._on_session_lost(why, fail_in_flight=msg.code is ErrorCode.HANDSHAKE_REQUIRED)

    def _resend_in_full(self, msg: Error) -> bool:
        """The gateway did not hold an item sent by hash (evicted, or refused with an
        earlier request): nothing was accepted, so send the request again with every
        tensor, once."""
        state = self._streams.get(msg.request_id or "")
        if state is None or state.resend is None or state.abandoned or not self.connected:
            return False
        message, state.resend = state.resend, None
        try:
            payload = self._encode_within_limit(message, message.request_id)
        except RequestFailed as exc:  # the full request exceeds max_frame_bytes: it ends here
            self._end_stream(message.request_id, exc)
            return True
        self._multimodal_sent.update(item.hash for item in message.multimodal or ())
        self.multimodal_resends += 1
        self._send_payload(payload)
        return True

    def _end_stream(self, request_id: str, exc: BaseException) -> None:
        state = self._streams.get(request_id)
        if state is None:
            return
        if state.abandoned:
            del self._streams[request_id]
        else:
            state.push(exc)

    def _fail_all(self, exc: GatewayUnavailable) -> None:
        """End every stream and call with ``exc``; their ids are free again at once."""
        streams, self._streams = self._streams, {}
        for state in streams.values():
            if not state.abandoned:
                state.push(exc)
        for future in [*self._calls.values(), *self._pongs.values(), *self._abort_waiters.values()]:
            if not future.done():
                future.set_exception(exc)
        self._calls.clear()
        self._pongs.clear()
        self._abort_waiters.clear()


def curve_hint(with_keys: bool) -> str:
    """What a silent gateway most often means, for a client with or without CURVE keys."""
    if with_keys:
        return (
            "a CURVE gateway answers nothing to a key it does not allow, or is another"
            " gateway's public key given?"
        )
    return (
        "a CURVE gateway answers nothing to a client without keys"
        " (curve_keys=client.load_client_keys(server.key, NAME.key_secret))"
    )
