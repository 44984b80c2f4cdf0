"""The gateway server: one ZeroMQ ROUTER socket in front of one Engine.

Rule: this is the only module with socket code, and it holds no protocol
rules. Three loops run in one TaskGroup: receive (recv, decode, table, carry
out effects), outputs (the engine calls back with each step: table, one Outputs
frame per client) and housekeeping (heartbeat expiry, drain deadline). Exceptions become Error
frames here and nowhere else. Sends never block: a client that cannot take
a frame is handled by the table, never waited for.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import gc
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import zmq
import zmq.asyncio

from codec import (
    CONTROL_MESSAGES,
    VERSION_FRAME,
    Error,
    ErrorCode,
    ProtocolError,
    ServerMessage,
    decode_client,
)
from codec.bounds import WireBounds
from codec.framing import DEFAULT_MAX_FRAME_BYTES, encode_payload, message_kind, peek_ids

from .auth import ControlPolicy, CurveConfig
from .control import ENGINE_STATE_CALLS, control_reply
from .engine import Engine, StepOutput
from .errors import EngineDead, RequestRejected, SubmitFailed, WeightsIncomplete
from .loop_watched_socket import LoopWatchedSocket
from .metrics import StepHistogram
from .preflight import ipc_path_in_use
from .sessions import Effects, GatewayLimits, SessionTable
from .weight_updates import DEFAULT_STALL_TIMEOUT_S, WeightUpdates

__all__ = ["Gateway", "Listener", "BindError", "EXIT_OK", "EXIT_ENGINE_DEAD"]

logger = logging.getLogger("engine_gateway")

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3
_HOUSEKEEPING_S = 0.1
_CURVE_HEARTBEAT_MS = 1000  # ZMTP heartbeats on CURVE connections (see Listener)
_PAUSE_S = 0.25  # a housekeeping tick this late means the process itself did not run
_PAUSE_LOGGED_S = 1.0
# zmq drops (and disconnects) peers whose messages exceed this; the protocol
# limit (max_frame_bytes) is checked ourselves, below this, to answer an Error naming the
# request or call. At least 32 MiB: a default limit that follows a small model's length
# (64 KiB and up) must still answer a vocabulary-sized logit_bias with FRAME_TOO_LARGE.
_HARD_MESSAGE_FACTOR = 4
_HARD_MESSAGE_FLOOR = 32 * 1024 * 1024
_YIELD_EVERY = 32  # inbound frames handled before the receive loop yields
_YIELD_AFTER_S = 0.002  # ...or this much time holding the event loop, whichever first
# While a slow consumer is owed frames, replies to what it sends meanwhile (pongs,
# refusals) are held up to this many; every frame owed before that is always held.
_BACKLOG_EXTRA_REPLIES = 1024


def freeze_startup_heap() -> None:
    """Move every object alive now (vLLM, torch and their imports: ~600k on the tiny
    model) out of the garbage collector's reach: its full collections then scan only
    what serving allocates, instead of stopping the event loop for ~0.35 s each (2-core
    box; bench/results/gateway_cpu.md). Call once, after start-up, in the serving
    process (it affects the whole process: an embedding application decides for itself)."""
    gc.collect()
    gc.freeze()


class BindError(Exception):
    """An address could not be bound (in use, bad syntax, no permission)."""

    def __init__(self, address: str, message: str):
        super().__init__(f"{address}: {message}")
        self.address = address
        self.message = message


class Listener:
    """The gateway's ROUTER socket, bound to its addresses (before the engine starts).

    The constructor raises BindError, with the socket closed, if any address fails.
    """

    def __init__(
        self,
        binds: Sequence[str],
        limits: GatewayLimits,
        *,
        context: zmq.asyncio.Context | None = None,
        curve: CurveConfig | None = None,
    ):
        self._own_ctx = context is None
        self.ctx = context or zmq.asyncio.Context()
        # Receives wait on the loop's watch of the descriptor, sends go straight to libzmq
        # (pyzmq's asyncio layer cost a Future and several ZMQ_EVENTS reads per frame).
        # The receive loop yields on its own schedule (_YIELD_EVERY, _YIELD_AFTER_S).
        self.sock = LoopWatchedSocket.adopt(
            self.ctx.socket(zmq.ROUTER), sends=True, yield_when_waiting=False
        )
        self.addresses: list[str] = []
        self._authenticator = None
        self.curve_on = curve is not None  # frames carry their sender's CURVE key
        sock = self.sock
        try:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH tells us a client left
            if curve is None:
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # same identity reconnecting takes over
            else:
                # With CURVE a routing id is not a credential: a second connection under an
                # id in use is ignored by ZeroMQ (it would get the first one's outputs), and
                # ZMTP heartbeats end a dead connection's pipe within seconds, so that its
                # client can reconnect under its id.
                sock.setsockopt(zmq.HEARTBEAT_IVL, _CURVE_HEARTBEAT_MS)
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5 * _CURVE_HEARTBEAT_MS)
            frame_limit = limits.max_frame_bytes or DEFAULT_MAX_FRAME_BYTES
            hard_limit = max(frame_limit * _HARD_MESSAGE_FACTOR, _HARD_MESSAGE_FLOOR)
            sock.setsockopt(zmq.MAXMSGSIZE, hard_limit)
            sock.setsockopt(zmq.SNDHWM, limits.client_send_hwm)
            sock.setsockopt(zmq.LINGER, 2000)
            if curve is not None:
                self._authenticator = curve.apply(self.ctx, sock)
            for address in binds:
                if address.startswith("ipc://") and ipc_path_in_use(address[6:]):
                    raise BindError(address, "address already in use (a process serves there)")
                try:
                    sock.bind(address)
                except zmq.ZMQError as exc:
                    reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc
                    raise BindError(address, str(reason)) from None
                self.addresses.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            self.close(linger=0)
            raise

    def close(self, linger: int = 2000) -> None:
        self.sock.close(linger=linger)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        if self._own_ctx:
            self.ctx.term()


class Gateway:
    """Serves ``engine`` on ``bind`` addresses (tcp:// or ipc://) until stopped.

    ``listener``: sockets bound beforehand (the CLI binds before starting the
    engine); the gateway closes it when it stops. Otherwise ``serve`` binds.
    """

    def __init__(
        self,
        engine: Engine,
        bind: str | Sequence[str],
        limits: GatewayLimits = GatewayLimits(),
        *,
        drain_timeout_s: float = 30.0,
        engine_dead_grace_s: float = 1.0,
        gateway_version: str = "0",
        context: zmq.asyncio.Context | None = None,
        curve: CurveConfig | None = None,
        listener: Listener | None = None,
        control: ControlPolicy = ControlPolicy(),
        engine_id_prefix: str = "g",
        weight_update_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        cache_isolation: bool = False,
    ):
        self.engine = engine
        self.control = control
        self.weight_updates = WeightUpdates(weight_update_timeout_s)
        self._tasks: set[asyncio.Task] = set()  # control calls and aborts under way
        # (client, call, token): calls not answered yet (ENGINE_DEAD answers them).
        # token -> (client, call); a call may hold maps (weight transfer): not hashable.
        self._controls_in_flight: dict[object, tuple[bytes, Any]] = {}
        self._engine_state_lock = asyncio.Lock()  # ENGINE_STATE_CALLS, one at a time
        self.limits = limits = limits.for_model(
            engine.info.max_model_len, bool(engine.info.modalities)
        )
        self.binds = [bind] if isinstance(bind, str) else list(bind)
        self.drain_timeout_s = drain_timeout_s
        self.engine_dead_grace_s = engine_dead_grace_s
        self.table = SessionTable(
            engine.info,
            engine.prepare,
            limits,
            gateway_version,
            engine_load=getattr(engine, "engine_load", None),
            engine_id_prefix=engine_id_prefix,
            prefix_query=getattr(engine, "prefix_query", None),
            cache_isolation=cache_isolation,
            kv_transfer_allowed=control.allows,
        )
        self.addresses: list[str] = []
        self.ready = asyncio.Event()
        self.exit_code = EXIT_OK
        self._ctx = context
        self._listener = listener
        self._sock: LoopWatchedSocket | None = None
        self._stop = asyncio.Event()
        self._drain_deadline: float | None = None
        self._exit_at: float | None = None  # engine died: refusals until then, then exit
        self._pending_aborts: list[str] = []
        # Frames owed to slow consumers (their pipe was full), retried each tick, and
        # how many later replies were held or dropped for each of them.
        self._backlog: dict[bytes, collections.deque[list[bytes]]] = {}
        self._backlog_extra: collections.Counter[bytes] = collections.Counter()
        self._curve = curve
        self._curve_on = False  # set by serve(), from the listener
        self.frames_sent = 0
        self.frames_dropped = 0
        self.errors_by_code: collections.Counter[ErrorCode] = collections.Counter()
        self.step_histogram = StepHistogram()

    # ------------------------------------------------------------ control

    def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new requests; stop once live ones finish or the deadline passes."""
        if self._drain_deadline is None:
            timeout = self.drain_timeout_s if timeout_s is None else timeout_s
            self._drain_deadline = time.monotonic() + timeout
            self.table.start_drain()
            logger.info(
                "draining: %d live requests, deadline %.1fs", self.table.live_requests, timeout
            )

    def stop(self, exit_code: int = EXIT_OK) -> None:
        """Stop at once (live requests are not ended; prefer drain())."""
        self.exit_code = exit_code
        self._stop.set()

    # ------------------------------------------------------------ main

    @property
    def curve_on(self) -> bool:
        """Whether its socket is a CURVE server (known once it serves)."""
        return self._curve_on

    async def serve(self) -> int:
        """Run until stopped; returns the process exit code to use."""
        listener = self._listener or Listener(
            self.binds, self.limits, context=self._ctx, curve=self._curve
        )
        self._listener = None  # closed below: a second serve() binds afresh
        sock = listener.sock
        self._sock = sock
        self._curve_on = listener.curve_on
        self.addresses = listener.addresses
        try:
            self.ready.set()
            async with asyncio.TaskGroup() as tasks:
                loops = [
                    tasks.create_task(self._receive_loop(sock)),
                    tasks.create_task(self._output_loop()),
                    tasks.create_task(self._housekeeping_loop()),
                ]
                await self._stop.wait()
                for loop in loops:
                    loop.cancel()
        finally:
            listener.close(linger=2000 if self.exit_code == EXIT_OK else 500)
        return self.exit_code

    # ------------------------------------------------------------ loops

    async def _receive_loop(self, sock: LoopWatchedSocket) -> None:
        table = self.table
        max_frame = self.limits.max_frame_bytes
        bounds = WireBounds.of(table.wire_limits, table.info.vocab_size)
        clock = time.perf_counter
        received = 0
        held_since = clock()
        policy = self.control
        # With CURVE, read frames with their CURVE User-Id: sessions belong to a key, and a
        # control key allow-list checks it.
        copy = not (policy.needs_user_id or self._curve_on)
        user_id = None
        while True:
            frames = await sock.recv_multipart(copy=copy)
            if not copy:
                user_id = frames[-1].get("User-Id")
                frames = [frame.bytes for frame in frames]
            received += 1
            if received % _YIELD_EVERY == 0 or clock() - held_since > _YIELD_AFTER_S:
                # A queued frame is returned without yielding: a flood, or a few
                # large frames, would otherwise starve the output loop and heartbeats.
                await asyncio.sleep(0)
                held_since = clock()
            client_id = frames[0]
            now = time.monotonic()
            try:
                # A control call from a client not allowed is refused from its tag alone.
                kind = message_kind(frames[2]) if len(frames) == 3 else None
                refused = kind in CONTROL_MESSAGES and table.before_decode(
                    client_id,
                    kind,
                    now,
                    policy.allows(user_id),
                    lambda: peek_ids(frames[2])[1],  # noqa: B023 - called at once
                    user_id,
                )
                if refused:
                    await self._apply(refused)
                    continue
                try:
                    msg = decode_client(frames[1:], max_frame, bounds)
                except ProtocolError as exc:
                    effects = table.on_protocol_error(client_id, exc, now)
                else:
                    if type(msg) in CONTROL_MESSAGES:
                        authorized = policy.allows(user_id)
                        effects = table.on_control(
                            client_id, msg, now, authorized, user_id, self.weight_updates.refusal
                        )
                    else:
                        effects = table.on_message(client_id, msg, now, user_id)
                await self._apply(effects)
            except Exception as exc:  # a bug: answer this frame, keep serving everyone
                logger.exception("handling a frame from %r failed", client_id)
                self._send(
                    client_id,
                    Error(None, ErrorCode.INTERNAL, f"the gateway failed on this frame: {exc!r}"),
                )

    async def _output_loop(self) -> None:
        try:
            await self.engine.run_outputs(self._on_step)
        except EngineDead as exc:
            self._on_engine_dead(exc.message)

    def _on_step(self, outputs: Sequence[StepOutput]) -> None:
        """One engine step, called by the engine as it delivers it: one Outputs frame
        per client, and aborts for samples a stop sequence ended."""
        start = time.perf_counter()
        effects = self.table.on_step(outputs, time.monotonic(), self.engine.weight_version)
        send = self._send
        for client_id, msg in effects.replies:
            send(client_id, msg)
        self.step_histogram.observe(time.perf_counter() - start)
        if effects.abort:  # the engine would go on with them: stop them now
            self._spawn(self._abort_in_engine(effects.abort))

    async def _housekeeping_loop(self) -> None:
        table = self.table
        while True:
            due = time.monotonic() + _HOUSEKEEPING_S
            await asyncio.sleep(_HOUSEKEEPING_S)
            now = time.monotonic()
            paused = now - due
            if paused > _PAUSE_S:
                # This process did not run (host paused, CPU-throttled, loop held): the
                # clients' frames wait unread in the socket, their silence is ours.
                table.forgive(paused, now)
                self.weight_updates.forgive(paused)
                if paused >= _PAUSE_LOGGED_S:
                    logger.warning(
                        "the gateway did not run for %.1fs (host paused or CPU-throttled?);"
                        " heartbeat timeouts skip that time",
                        paused,
                    )
            expired = table.stats.clients_expired
            await self._apply(table.expire(now))
            if table.stats.clients_expired > expired:
                logger.warning(
                    "%d client session(s) expired: silent past their heartbeat timeout",
                    table.stats.clients_expired - expired,
                )
            if reason := self.weight_updates.abandon_reason(now, table.has_session):
                self.weight_updates.abandoning = True
                self._spawn(self._abandon_weight_update(reason))
            if self._backlog:
                self._flush_backlogs()
            if self._pending_aborts:
                aborts, self._pending_aborts = self._pending_aborts, []
                await self._abort_in_engine(aborts)
            if self._exit_at is not None:
                if now >= self._exit_at:
                    self.stop(EXIT_ENGINE_DEAD)
            elif self._drain_deadline is not None:
                if table.live_requests == 0:
                    logger.info("drained: no live requests left")
                    self.stop(self.exit_code)
                elif now >= self._drain_deadline:
                    logger.info("drain deadline: aborting %d live requests", table.live_requests)
                    await self._apply(table.abort_all(now))
                    self.stop(self.exit_code)

    # ------------------------------------------------------------ effects

    async def _apply(self, effects: Effects) -> None:
        for client_id, msg in effects.replies:
            self._send(client_id, msg)
        if effects.submit:
            await self._submit(effects.submit)
        if effects.abort:
            await self._abort_in_engine(effects.abort)
        for client_id, call in effects.control:
            # Run beside the loops: Pause(wait) returns only once requests drained.
            self._spawn(self._run_control(client_id, call))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` beside the loops, holding it until it is done."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_control(self, client_id: bytes, call) -> None:  # noqa: ANN001
        """Make one allowed control call on the engine; answer with its result or an Error.

        Calls that change the engine's state wait their turn (arrival order). A call still
        under way when the engine dies is answered ENGINE_DEAD by ``_on_engine_dead``."""
        token = object()  # one per call, even for identical frames
        self._controls_in_flight[token] = (client_id, call)
        try:
            reply = await self._control_reply(call, client_id)
        finally:
            answered = self._controls_in_flight.pop(token, None) is None
        if not answered:
            self._send(client_id, reply)

    async def _control_reply(self, call, client_id: bytes) -> ServerMessage:  # noqa: ANN001
        try:
            if isinstance(call, ENGINE_STATE_CALLS):
                async with self._engine_state_lock:
                    try:
                        return await control_reply(
                            self.engine,
                            self.table,
                            call,
                            client_id,
                            self.weight_updates,
                            time.monotonic(),
                        )
                    except WeightsIncomplete as exc:  # before the next call's turn
                        await self._end_half_updated_serving(exc.message)
                        return Error(None, exc.code, exc.message, call.call_id)
            return await control_reply(self.engine, self.table, call)
        except EngineDead as exc:
            self._on_engine_dead(exc.message)
            reply = Error(None, ErrorCode.ENGINE_DEAD, exc.message, call.call_id)
        except RequestRejected as exc:  # e.g. an unknown LoRA name: the caller's mistake
            reply = Error(None, exc.code, exc.message, call.call_id)
        except NotImplementedError as exc:  # EngineControls: the engine lacks it
            reply = Error(
                None,
                ErrorCode.UNSUPPORTED,
                f"{type(call).__name__} is not supported by this engine: {exc}",
                call.call_id,
            )
        except Exception as exc:  # vLLM refused or failed: its words, the gateway goes on
            logger.exception("control call %r failed", call)
            reply = Error(
                None, ErrorCode.INTERNAL, f"{type(call).__name__} failed: {exc!r}", call.call_id
            )
        return reply

    async def _end_half_updated_serving(self, message: str) -> None:
        """A weight update failed part-way: end every live request (a half-updated model
        may not serve them), then let the engine run again (new requests are refused)."""
        logger.error("weight update failed part-way: %s", message)
        ended = self.table.fail_all(ErrorCode.WEIGHTS_INCOMPLETE, message, time.monotonic())
        await self._apply(ended)
        await self.engine.release_weight_hold()

    async def _abandon_weight_update(self, reason: str) -> None:
        """End the open weight update from the gateway's side (its trainer is gone or
        stalled): the engine gets back the old weights of every layer not yet updated."""
        updates = self.weight_updates
        try:
            async with self._engine_state_lock:
                # Asked again under the lock: a call that ran meanwhile may have ended the
                # update or continued it.
                updates.abandoning = False
                reason = updates.abandon_reason(time.monotonic(), self.table.has_session)
                if reason is None:
                    return
                updates.abandoning = True
                logger.warning("ending the open weight update: %s", reason)
                try:
                    await self.engine.abandon_weight_update(reason)
                except WeightsIncomplete as exc:
                    await self._end_half_updated_serving(exc.message)
                except EngineDead as exc:
                    self._on_engine_dead(exc.message)
                except Exception:
                    logger.exception("ending the open weight update failed")
                    await self.engine.release_weight_hold()  # generation is not left held
                updates.abandoned()
        finally:
            updates.abandoning = False

    async def _submit(self, prepared: Sequence) -> None:
        """Submit to the engine; a request that fails to submit fails alone."""
        table = self.table
        while prepared:
            try:
                await self.engine.add_requests(prepared)
                return
            except EngineDead as exc:
                self._on_engine_dead(exc.message)
                return
            except SubmitFailed as exc:
                logger.error("submitting %s failed: %s", exc.engine_request_id, exc.message)
                failed = table.on_submit_failed(
                    exc.engine_request_id, exc.message, time.monotonic()
                )
                await self._apply(failed)
                prepared = [p for p in prepared if table.is_live(p.request_id)]

    async def _abort_in_engine(self, engine_request_ids: list[str]) -> None:
        try:
            await self.engine.abort_requests(engine_request_ids)
        except EngineDead as exc:
            self._on_engine_dead(exc.message)

    def _send(self, client_id: bytes, msg: ServerMessage) -> None:
        if type(msg) is Error:
            self.errors_by_code[msg.code] += 1
        frames = [client_id, VERSION_FRAME, encode_payload(msg)]
        backlog = self._backlog.get(client_id)
        if backlog is not None:  # keep order behind what is already owed
            self._queue_reply(client_id, backlog, frames)
            return
        exc = self._try_send(frames)
        if exc is None:
            return
        if isinstance(exc, zmq.Again):
            # The client's pipe is full (client_send_hwm frames): it is not reading.
            # Keep this frame and everything the table now owes it, in order.
            self._backlog[client_id] = collections.deque([frames])
            effects = self.table.on_send_blocked(client_id, time.monotonic())
            self._pending_aborts.extend(effects.abort)
            logger.warning(
                "client %r is not reading; ended %d requests", client_id, len(effects.replies)
            )
            for _, reply in effects.replies:
                self._backlog[client_id].append([client_id, VERSION_FRAME, encode_payload(reply)])
        elif isinstance(exc, zmq.ZMQError) and exc.errno == errno.EHOSTUNREACH:
            # The client is gone: stop spending engine time on it (the
            # housekeeping loop tells the engine within one tick).
            self.frames_dropped += 1
            gone = self.table.on_client_gone(client_id, time.monotonic())
            self._pending_aborts.extend(gone.abort)
        else:
            self.frames_dropped += 1
            logger.warning("send to %r failed: %r", client_id, exc)

    def _try_send(self, frames: list[bytes]) -> BaseException | None:
        """Send without blocking; returns the error instead of raising it."""
        sock = self._sock
        assert sock is not None
        exc = sock.send_nowait(frames)
        if exc is None:
            self.frames_sent += 1
        return exc

    def _queue_reply(self, client_id: bytes, backlog: collections.deque, frames: list) -> None:
        """A frame for a slow consumer made after it blocked: a reply to what it sent since."""
        self._backlog_extra[client_id] += 1
        if self._backlog_extra[client_id] > _BACKLOG_EXTRA_REPLIES:
            self.frames_dropped += 1  # no request is live for it: nothing terminal is lost
            return
        backlog.append(frames)

    def _flush_backlogs(self) -> None:
        """Deliver frames owed to slow consumers; forget clients that left."""
        for client_id, backlog in list(self._backlog.items()):
            while backlog:
                exc = self._try_send(backlog[0])
                if exc is None:
                    backlog.popleft()
                elif isinstance(exc, zmq.Again):
                    break
                else:  # gone for good
                    self.frames_dropped += len(backlog)
                    backlog.clear()
            if not backlog:
                del self._backlog[client_id]
                dropped = self._backlog_extra.pop(client_id, 0) - _BACKLOG_EXTRA_REPLIES
                if dropped > 0:
                    logger.warning(
                        "client %r: %d replies dropped while it was not reading", client_id, dropped
                    )
                self.table.on_send_unblocked(client_id)

    def _on_engine_dead(self, message: str) -> None:
        if self._exit_at is not None:
            return
        logger.error(
            "engine died: %s; ending %d live requests, refusing new ones for %.1fs, then exiting",
            message,
            self.table.live_requests,
            self.engine_dead_grace_s,
        )
        self.exit_code = EXIT_ENGINE_DEAD
        self._exit_at = time.monotonic() + self.engine_dead_grace_s
        # Control calls under way: the engine will never answer them.
        for client_id, call in self._controls_in_flight.values():
            error = Error(None, ErrorCode.ENGINE_DEAD, f"engine died: {message}", call.call_id)
            self._send(client_id, error)
        self._controls_in_flight.clear()
        for client_id, msg in self.table.on_engine_dead(
            f"engine died: {message}", time.monotonic()
        ).replies:
            self._send(client_id, msg)
