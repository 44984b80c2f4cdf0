"""A ``zmq.asyncio`` socket whose receives wait on the event loop's own watch of the
socket's file descriptor.

pyzmq's asyncio layer makes every ``await recv_multipart()`` a Future with its own
bookkeeping: a ``RCVTIMEO`` read, several ``ZMQ_EVENTS`` reads (each processes the socket's
commands), flag-enum arithmetic and a done-callback that costs another loop pass. At an
engine step's cadence that is ~100 µs of CPU per frame more than receiving with
``NOBLOCK`` when the loop says the descriptor is readable (``python -m bench.probes.recv_cost``).

``LoopWatchedSocket.adopt(sock)`` turns an existing ``zmq.asyncio.Socket`` into one whose
blocking ``recv_multipart`` is that: the socket stays the same object (so code that holds
it, checks ``isinstance(sock, zmq.asyncio.Socket)`` or closes it keeps working);
``NOBLOCK`` receives and everything else but sends are pyzmq's. It is for a socket with
one receiving task; the gateway uses it for vLLM's engine-output socket (PULL) and for its
own ROUTER. By default a receive that finds a frame already there still yields to the loop
once, so a task that handles what it receives inline cannot hold the loop through a
backlog; a receiving loop with its own yield policy (the gateway's ROUTER: every 32 frames
or 2 ms) adopts its socket with ``yield_when_waiting=False``.

Sends are the subtle part. A send processes the socket's pending commands, so it can
consume the descriptor's edge of a frame that arrived meanwhile, and a blocked asyncio send
would register pyzmq's own reader on the descriptor in place of this one. So a socket that
sends is adopted with ``sends=True``: it sends only through ``send_nowait`` (never blocks;
after sending it reads ``ZMQ_EVENTS`` and wakes a waiting receive, as pyzmq does after its
own sends), and pyzmq's asyncio ``send``/``send_multipart`` are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import zmq
import zmq.asyncio

_POLLIN = int(zmq.POLLIN)  # an int: pyzmq's flag enum costs ~1 µs per `&` on Python 3.11
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_EVENTS = int(zmq.EVENTS)
_RECEIVE_ONLY = (int(zmq.PULL), int(zmq.SUB))
# libzmq's send, without pyzmq's Python wrapper (flag enums, copy-threshold checks):
# ~3 µs for a three-part message against ~9 through Socket.send_multipart.
_send_frame = zmq.Socket.__mro__[1].send


class LoopWatchedSocket(zmq.asyncio.Socket):
    """A ``zmq.asyncio.Socket`` whose blocking ``recv_multipart`` receives with ``NOBLOCK``
    and, when nothing is waiting, awaits the loop's reader callback on the socket's FD.

    The callback is registered on the first receive and stays until ``close``; it reads
    ``ZMQ_EVENTS`` every time the descriptor fires (which also re-arms ZeroMQ's
    edge-triggered descriptor) and wakes the waiting receive once a message is there.
    Closing the socket cancels a waiting receive, as pyzmq's does.
    """

    _watch_loop: asyncio.AbstractEventLoop | None = None
    _watch_fd: int = -1
    _watch_plain: zmq.Socket | None = None
    _watch_waiter: asyncio.Future[None] | None = None

    _watch_sends: bool = False
    _watch_yield_when_waiting: bool = True

    @classmethod
    def adopt(
        cls,
        sock: zmq.asyncio.Socket,
        *,
        sends: bool = False,
        yield_when_waiting: bool = True,
    ) -> LoopWatchedSocket:
        """Make ``sock`` (a plain ``zmq.asyncio.Socket`` with no receive timeout and no
        receive or send under way) a LoopWatchedSocket, in place, and return it.

        ``sends``: the socket can send, and will only through ``send_nowait``. Without
        it a socket that can send (not PULL or SUB) is refused.
        ``yield_when_waiting``: a receive that finds a frame already there lets the loop
        run once before returning it (False: returns it at once, as pyzmq does)."""
        if type(sock) is not zmq.asyncio.Socket:
            raise TypeError(f"expected a zmq.asyncio.Socket, got {type(sock).__name__}")
        if sock.type not in _RECEIVE_ONLY and not sends:
            raise ValueError(
                f"a {zmq.SocketType(sock.type).name} socket can send: adopt it with sends=True"
            )
        if sock.rcvtimeo >= 0:
            raise ValueError("a socket with a receive timeout keeps pyzmq's receive")
        sock.__class__ = cls
        assert isinstance(sock, LoopWatchedSocket)
        sock._watch_plain = zmq.Socket.shadow(sock.underlying)
        sock._watch_sends = sends
        sock._watch_yield_when_waiting = yield_when_waiting
        return sock

    def send_nowait(self, frames: list[bytes]) -> zmq.ZMQError | None:
        """Send one multipart message without blocking; return the error (``zmq.Again``:
        the peer's pipe is full; ``EHOSTUNREACH`` from a ROUTER_MANDATORY socket: no such
        peer) instead of raising it. Then wake a waiting receive if the send took the
        descriptor's edge of a frame that arrived meanwhile."""
        plain = self._watch_plain
        if plain is None or not self._watch_sends:
            raise TypeError("adopt the socket with sends=True to send through it")
        error = None
        try:
            last = len(frames) - 1
            for i, frame in enumerate(frames):
                _send_frame(plain, frame, _MORE_NOBLOCK if i < last else _NOBLOCK)
        except zmq.ZMQError as exc:
            error = exc
        waiter = self._watch_waiter
        if waiter is not None and not waiter.done() and plain.get(_EVENTS) & _POLLIN:
            waiter.set_result(None)
        return error

    def send(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("a LoopWatchedSocket sends only through send_nowait")

    def send_multipart(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise TypeError("a LoopWatchedSocket sends only through send_nowait")

    def recv_multipart(  # type: ignore[override]
        self, flags: int = 0, copy: bool = True, track: bool = False
    ) -> Any:
        if flags & _NOBLOCK:
            return super().recv_multipart(flags, copy=copy, track=track)
        return self._receive(copy, track)

    async def _receive(self, copy: bool, track: bool) -> list[Any]:
        plain = self._watch_plain
        assert plain is not None
        # ZMQ_EVENTS first: a receive that finds nothing raises zmq.Again, which costs more
        # than the read. Once woken, the callback has just seen POLLIN.
        ready = plain.get(_EVENTS) & _POLLIN
        if ready and self._watch_yield_when_waiting:
            # A frame was already waiting (frames came faster than they are handled):
            # let the loop's other tasks run first, as they do between frames that
            # arrive apart, or a backlog would hold the loop until it is worked off.
            await asyncio.sleep(0)
        while True:
            if ready:
                try:
                    return plain.recv_multipart(_NOBLOCK, copy=copy, track=track)
                except zmq.Again:
                    pass
            waiter = self._readable()
            try:
                await waiter
            finally:
                self._watch_waiter = None
            ready = _POLLIN

    def _readable(self) -> asyncio.Future[None]:
        if self._watch_waiter is not None:
            raise RuntimeError("LoopWatchedSocket: only one receive may wait at a time")
        loop = asyncio.get_running_loop()
        if self._watch_loop is None:
            plain = self._watch_plain
            assert plain is not None
            self._watch_fd = plain.get(zmq.FD)
            loop.add_reader(self._watch_fd, self._on_descriptor)
            self._watch_loop = loop
        elif self._watch_loop is not loop:
            raise RuntimeError("LoopWatchedSocket is watched by another event loop")
        waiter = self._watch_waiter = loop.create_future()
        return waiter

    def _on_descriptor(self) -> None:
        plain = self._watch_plain
        assert plain is not None  # set by adopt, before the first receive registers this
        if plain.closed:
            return
        try:
            events = plain.get(_EVENTS)  # also re-arms the descriptor
        except zmq.ZMQError:
            events = _POLLIN  # let the receive meet the error
        waiter = self._watch_waiter
        if events & _POLLIN and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self, linger: int | None = None) -> None:
        loop, self._watch_loop = self._watch_loop, None
        if loop is not None and not loop.is_closed() and self._watch_fd >= 0:
            loop.remove_reader(self._watch_fd)
        waiter = self._watch_waiter
        if waiter is not None and not waiter.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed: teardown
                waiter.cancel()
        super().close(linger=linger)
