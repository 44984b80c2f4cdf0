"""LoopWatchedSocket: receives that wait on the loop's watch of the socket's descriptor.
Each test runs on asyncio's own loop and on uvloop (the gateway's), over ipc://."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvloop
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.loop_watched_socket import LoopWatchedSocket
from tests.conftest import ipc_address

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run_on(loop_name: str, test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop_name]) as runner:
        runner.run(asyncio.wait_for(test(), 20))


@contextlib.asynccontextmanager
async def pull_and_push(
    cls: type[LoopWatchedSocket] = LoopWatchedSocket,
    **adopt_options: bool,
) -> AsyncIterator[tuple[LoopWatchedSocket, zmq.Socket]]:
    """A watched PULL socket (made by pyzmq's asyncio context, then adopted) and a plain
    PUSH socket connected to it; both closed on exit."""
    address = ipc_address("watched")
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    pull = cls.adopt(actx.socket(zmq.PULL), **adopt_options)
    pull.bind(address)
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    try:
        yield pull, push
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        actx.term()


@pytest.fixture(params=sorted(LOOPS))
def loop_name(request) -> str:
    return request.param


def test_adopt_keeps_the_object_an_asyncio_socket_and_refuses_what_it_cannot_watch():
    """Refused: an adopted or plain socket, one with a receive timeout, one that sends."""
    actx = zmq.asyncio.Context()
    sock = actx.socket(zmq.PULL)
    assert LoopWatchedSocket.adopt(sock) is sock
    assert isinstance(sock, zmq.asyncio.Socket)
    with pytest.raises(TypeError):
        LoopWatchedSocket.adopt(sock)  # already adopted
    timed = actx.socket(zmq.PULL)
    timed.rcvtimeo = 100
    with pytest.raises(ValueError, match="receive timeout"):
        LoopWatchedSocket.adopt(timed)
    dealer = actx.socket(zmq.DEALER)
    with pytest.raises(ValueError, match="DEALER socket can send"):
        LoopWatchedSocket.adopt(dealer)
    plain = zmq.Context.instance().socket(zmq.PULL)
    with pytest.raises(TypeError):
        LoopWatchedSocket.adopt(plain)  # type: ignore[arg-type]
    for s in (sock, timed, dealer, plain):
        s.close(linger=0)
    actx.term()


def test_frames_sent_before_during_and_after_a_wait_all_arrive_in_order(loop_name):
    async def scenario() -> None:
        async with pull_and_push() as (pull, push):
            for i in range(3):  # waiting before the first receive: no edge left to see
                push.send_multipart([b"early", str(i).encode()])
            await asyncio.sleep(0.05)
            got = [await pull.recv_multipart() for _ in range(3)]
            assert got == [[b"early", b"0"], [b"early", b"1"], [b"early", b"2"]]

            # A receive that waits, woken by a frame sent later.
            asyncio.get_running_loop().call_later(0.05, push.send, b"late")
            assert await pull.recv_multipart() == [b"late"]

            # copy=False gives zmq.Frame objects, as pyzmq's receive does.
            push.send_multipart([b"a", b"b"])
            frames = await pull.recv_multipart(copy=False)
            assert [f.bytes for f in frames] == [b"a", b"b"]
            assert all(isinstance(f, zmq.Frame) for f in frames)

    run_on(loop_name, scenario)


def test_a_frame_that_fires_the_descriptor_while_nobody_waits_is_still_received(loop_name):
    """The callback reads ZMQ_EVENTS (re-arming ZeroMQ's edge) with no receive waiting; the
    next receive must still find the frame, and one after that must still be woken."""

    async def scenario() -> None:
        async with pull_and_push() as (pull, push):
            push.send(b"0")
            assert await pull.recv_multipart() == [b"0"]  # the descriptor is now watched
            for i in range(1, 20):
                push.send(str(i).encode())
                await asyncio.sleep(0.005)  # the descriptor fires; nobody is waiting
                assert await pull.recv_multipart() == [str(i).encode()]
            asyncio.get_running_loop().call_later(0.02, push.send, b"woken")
            assert await pull.recv_multipart() == [b"woken"]

    run_on(loop_name, scenario)


def test_a_frame_already_waiting_is_received_only_after_the_loop_ran_once(loop_name):
    """A backlog must not hold the loop: each receive that finds a frame there yields first
    (the gateway handles a step inside the receiving task)."""

    async def scenario() -> None:
        async with pull_and_push() as (pull, push):
            for i in range(3):
                push.send(str(i).encode())
            await asyncio.sleep(0.05)  # all three wait in the socket
            for i in range(3):
                other_ran = asyncio.Event()
                asyncio.get_running_loop().call_soon(other_ran.set)
                assert await pull.recv_multipart() == [str(i).encode()]
                assert other_ran.is_set()

    run_on(loop_name, scenario)


def test_without_yield_when_waiting_a_waiting_frame_is_returned_at_once(loop_name):
    """A receiving loop with its own yield policy (the gateway's ROUTER) gets a frame that
    is already there without a loop pass, as from pyzmq's receive."""

    async def scenario() -> None:
        async with pull_and_push(yield_when_waiting=False) as (pull, push):
            for i in range(3):
                push.send(str(i).encode())
            await asyncio.sleep(0.05)
            other_ran = asyncio.Event()
            asyncio.get_running_loop().call_soon(other_ran.set)
            for i in range(3):
                assert await pull.recv_multipart() == [str(i).encode()]
            assert not other_ran.is_set()

    run_on(loop_name, scenario)


class CountingSocket(LoopWatchedSocket):
    calls = 0

    def _on_descriptor(self) -> None:
        type(self).calls += 1
        super()._on_descriptor()


def test_a_frame_left_unreceived_does_not_spin_the_loop(loop_name):
    """With a frame waiting and no receive, the descriptor must not stay readable (the
    callback would then run on every loop pass)."""

    async def scenario() -> None:
        CountingSocket.calls = 0
        async with pull_and_push(CountingSocket) as (pull, push):
            push.send(b"first")
            assert await pull.recv_multipart() == [b"first"]
            with pytest.raises(zmq.Again):  # the pipe is empty: the next frame signals
                await pull.recv_multipart(zmq.NOBLOCK)
            push.send(b"left")
            await asyncio.sleep(0.3)
            assert CountingSocket.calls <= 3
            assert await pull.recv_multipart() == [b"left"]

    run_on(loop_name, scenario)


def test_close_cancels_a_waiting_receive_and_stops_watching(loop_name):
    async def scenario() -> None:
        async with pull_and_push() as (pull, push):
            push.send(b"x")
            await pull.recv_multipart()
            waiting = asyncio.ensure_future(pull.recv_multipart())
            await asyncio.sleep(0.02)
            pull.close(linger=0)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(waiting, 5)
            # The descriptor is no longer watched by this socket.
            assert not asyncio.get_running_loop().remove_reader(pull._watch_fd)

    run_on(loop_name, scenario)


def test_a_second_concurrent_receive_is_refused_and_noblock_is_pyzmqs(loop_name):
    async def scenario() -> None:
        async with pull_and_push() as (pull, push):
            with pytest.raises(zmq.Again):
                await pull.recv_multipart(zmq.NOBLOCK)
            first = asyncio.ensure_future(pull.recv_multipart())
            await asyncio.sleep(0.01)
            with pytest.raises(RuntimeError, match="one receive"):
                await pull.recv_multipart()
            push.send(b"one")
            assert await asyncio.wait_for(first, 5) == [b"one"]

    run_on(loop_name, scenario)


@settings(max_examples=15, deadline=None)
@given(
    bursts=st.lists(
        st.tuples(st.integers(1, 40), st.sampled_from([0.0, 0.0005, 0.003])),
        min_size=1,
        max_size=12,
    ),
    receiver_pause=st.sampled_from([0.0, 0.001]),
    loop_name=st.sampled_from(sorted(LOOPS)),
)
def test_any_schedule_of_bursts_and_pauses_arrives_whole_and_in_order(
    bursts, receiver_pause, loop_name
):
    """A sender thread sends bursts with pauses between them while the receiver sometimes
    pauses between receives: every frame arrives, in order, with no lost wake-up."""
    total = sum(n for n, _ in bursts)

    async def scenario() -> None:
        async with pull_and_push() as (pull, push):

            def send_all() -> None:
                i = 0
                for n, pause in bursts:
                    for _ in range(n):
                        push.send(i.to_bytes(4, "big"))
                        i += 1
                    time.sleep(pause)

            sender = asyncio.get_running_loop().run_in_executor(None, send_all)
            got = []
            for _ in range(total):
                (frame,) = await asyncio.wait_for(pull.recv_multipart(), 5)
                got.append(int.from_bytes(frame, "big"))
                if receiver_pause:
                    await asyncio.sleep(receiver_pause)
            await sender
            assert got == list(range(total))

    run_on(loop_name, scenario)


@contextlib.asynccontextmanager
async def router_and_dealer(
    dealer_rcvhwm: int | None = None, **router_options: int
) -> AsyncIterator[tuple[LoopWatchedSocket, zmq.Socket]]:
    """A watched ROUTER adopted with sends=True and a plain DEALER (identity b"peer")
    connected and known to it; both closed on exit."""
    address = ipc_address("watched-router")
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    router = actx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    for option, value in router_options.items():
        router.setsockopt(getattr(zmq, option), value)
    router = LoopWatchedSocket.adopt(router, sends=True)
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    if dealer_rcvhwm is not None:
        dealer.setsockopt(zmq.RCVHWM, dealer_rcvhwm)
    dealer.connect(address)
    try:
        dealer.send(b"hello")
        assert await asyncio.wait_for(router.recv_multipart(), 5) == [b"peer", b"hello"]
        yield router, dealer
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
        actx.term()


def test_a_send_that_takes_a_new_frames_edge_still_wakes_the_waiting_receive(loop_name):
    """The frame arrives while the loop is held; the send that follows processes the
    socket's commands (taking the descriptor's edge) before the loop polls again: the
    waiting receive must be woken by send_nowait itself."""

    async def scenario() -> None:
        async with router_and_dealer() as (router, dealer):
            for i in range(20):
                waiting = asyncio.ensure_future(router.recv_multipart())
                await asyncio.sleep(0.002)  # the receive now waits on the descriptor
                dealer.send(b"req%d" % i)
                time.sleep(0.02)  # hold the loop: the frame reaches the ROUTER's pipe
                assert router.send_nowait([b"peer", b"reply%d" % i]) is None
                assert await asyncio.wait_for(waiting, 2) == [b"peer", b"req%d" % i]
                assert dealer.recv() == b"reply%d" % i

    run_on(loop_name, scenario)


def test_send_nowait_returns_errors_and_pyzmqs_own_sends_are_refused(loop_name):
    async def scenario() -> None:
        # The peer does not read. Its queue holds one message and the kernel's socket
        # buffer a few of these 64 kB ones (tiny frames could fill that buffer's
        # hundreds of kB only as fast as zmq's I/O threads move them: CI once sent
        # 5000 without an Again).
        async with router_and_dealer(dealer_rcvhwm=1, SNDHWM=4) as (router, dealer):
            error = router.send_nowait([b"nobody", b"x"])
            assert isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH
            errors = []
            for i in range(5000):
                errors.append(router.send_nowait([b"peer", b"%d|" % i + bytes(65536)]))
                if errors[-1] is not None:
                    break
            assert errors[0] is None and isinstance(errors[-1], zmq.Again)  # not reading
            for send in (router.send, router.send_multipart):
                with pytest.raises(TypeError, match="send_nowait"):
                    send([b"peer", b"x"])
            # What was accepted is delivered, in order.
            assert dealer.recv().startswith(b"0|") and dealer.recv().startswith(b"1|")

    run_on(loop_name, scenario)
    actx = zmq.asyncio.Context()
    pull = LoopWatchedSocket.adopt(actx.socket(zmq.PULL))  # adopted to receive only
    with pytest.raises(TypeError, match="sends=True"):
        pull.send_nowait([b"x"])
    pull.close(linger=0)
    actx.term()


@settings(max_examples=12, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(st.integers(1, 30), st.integers(0, 30), st.sampled_from([0.0, 0.001])),
        min_size=1,
        max_size=10,
    ),
    loop_name=st.sampled_from(sorted(LOOPS)),
)
def test_receives_and_sends_interleaved_any_way_lose_nothing(rounds, loop_name):
    """A peer thread sends bursts while the loop answers every request and also sends
    extra frames of its own between receives: every request is received and every
    reply and extra frame delivered, in order, with no lost wake-up."""
    total = sum(n for n, _, _ in rounds)
    expected = total + sum(extra for _, extra, _ in rounds)

    async def scenario() -> None:
        async with router_and_dealer() as (router, dealer):
            got_back: list[bytes] = []

            def peer() -> None:
                i = 0
                for n, _, pause in rounds:
                    for _ in range(n):
                        dealer.send(b"q%d" % i)
                        i += 1
                    time.sleep(pause)
                while len(got_back) < expected and dealer.poll(5000):
                    got_back.append(dealer.recv())

            thread = asyncio.get_running_loop().run_in_executor(None, peer)
            received = []
            sent: list[bytes] = []
            for n, extra, _ in rounds:
                for _ in range(n):
                    _, body = await asyncio.wait_for(router.recv_multipart(), 5)
                    received.append(body)
                    sent.append(b"a" + body)
                    assert router.send_nowait([b"peer", sent[-1]]) is None
                for k in range(extra):
                    sent.append(b"x%d" % k)
                    assert router.send_nowait([b"peer", sent[-1]]) is None
            await thread
            assert received == [b"q%d" % i for i in range(total)]
            assert got_back == sent

    run_on(loop_name, scenario)
