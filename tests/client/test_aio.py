"""The client library's bookkeeping and forward compatibility, against real sockets.

A scripted gateway (a bare ROUTER speaking hand-made frames) plays a newer
gateway; the real Gateway on the fake engine covers aborts, dropped streams,
lagging consumers and sessions that expire or end.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq
import zmq.asyncio

from client import (
    AsyncClient,
    Client,
    FinishReason,
    RequestFailed,
    SamplingParams,
    SessionLost,
)
from client.aio import _MAX_PENDING_OUTPUTS
from codec import (
    VERSION_FRAME,
    Error,
    ErrorCode,
    Finished,
    Generate,
    Hello,
    HelloAck,
    Limits,
    ModelInfo,
    Outputs,
    RequestOutput,
    decode_client,
    encode,
)
from gateway.fake_engine import FakeEngine
from gateway.sessions import GatewayLimits
from tests.conftest import gateway_in_thread, ipc_address, running_gateway

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


class ScriptedGateway:
    """A ROUTER that answers Hello, then hands every other message to ``script``."""

    def __init__(self, script: Callable[[Callable, object], None]):
        self.address = ipc_address("scripted")
        self.script = script
        self.sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(self.address)
        self.task: asyncio.Task | None = None

    def send_raw(self, identity: bytes, payload: bytes) -> None:
        self.sock.send_multipart([identity, VERSION_FRAME, payload])

    async def _serve(self) -> None:
        while True:
            identity, *frames = await self.sock.recv_multipart()
            msg = decode_client(frames)
            if isinstance(msg, Hello):
                ack = HelloAck(
                    1,
                    "newer",
                    ModelInfo("m", 64, 100, [2]),
                    Limits(64, 8, 8, 1 << 20, 8, 5),
                    1.0,
                    3.0,
                )
                self.send_raw(identity, encode(ack)[1])
            else:
                self.script(lambda payload, i=identity: self.send_raw(i, payload), msg)

    async def __aenter__(self) -> ScriptedGateway:
        self.task = asyncio.ensure_future(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


async def test_a_newer_gateways_codes_reasons_and_messages_reach_the_caller():
    def script(send, msg) -> None:
        if not isinstance(msg, Generate):
            return
        send(msgspec.msgpack.encode([120, "a message from a newer gateway", {"x": 1}]))
        if msg.request_id == "reason":
            # A finish reason and an appended Finished field this client does not know.
            out = [
                "reason",
                [7, 8],
                [9, None, 1, 2, 0, None, 0, None, None, "future"],
                None,
                None,
                0,
                None,
                "x",
            ]
            send(msgspec.msgpack.encode([65, [out], "appended"]))
        else:
            send(msgspec.msgpack.encode([66, msg.request_id, 77, "a code from the future"]))

    async with ScriptedGateway(script) as gw, AsyncClient(gw.address) as client:
        outs = [o async for o in client.generate([1], request_id="reason")]
        assert [o.new_token_ids for o in outs] == [[7, 8]]
        reason = outs[0].finished.finish_reason
        assert reason == 9 and not reason.known and reason.name == "UNKNOWN_9"
        with pytest.raises(RequestFailed) as info:
            await client.complete([1], request_id="code")
        assert info.value.code == 77 and not info.value.code.known
        assert info.value.request_id == "code"
        assert client.connected  # unknown tags were skipped, the session goes on


async def test_connection_errors_are_bounded():
    def script(send, msg) -> None:
        for i in range(500):
            send(encode(Error(None, ErrorCode.INVALID_MESSAGE, f"e{i}"))[1])

    async with ScriptedGateway(script) as gw, AsyncClient(gw.address) as client:
        client._send(Generate("x", [1]))
        await asyncio.sleep(0.3)
        assert 0 < len(client.connection_errors) <= 64
        assert client.connection_errors[-1].message == "e499"


async def test_sends_a_gateway_does_not_read_wait_in_order_and_all_arrive():
    """Past ZeroMQ's high-water marks the client keeps what it sends (a full pipe says
    EAGAIN) and sends it, in order, once the gateway reads again."""
    reading = asyncio.Event()
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 8)
    router.setsockopt(zmq.LINGER, 0)
    address = ipc_address("stalled")
    router.bind(address)
    received: list[str] = []

    async def serve() -> None:
        identity, *frames = await router.recv_multipart()
        assert isinstance(decode_client(frames), Hello)
        ack = HelloAck(1, "g", ModelInfo("m", 64, 100, [2]), Limits(64, 8, 8, 1 << 20, 8, 5), 9, 30)
        await router.send_multipart([identity, *encode(ack)])
        await reading.wait()  # the gateway stops reading while the client sends
        while len(received) < total:
            _, *frames = await router.recv_multipart()
            received.append(decode_client(frames).request_id)

    total = 3000
    server = asyncio.ensure_future(serve())
    try:
        async with AsyncClient(address) as client:
            for i in range(total):
                client._send(Generate(f"r{i}", list(range(1000))))
            assert client._outbox  # the pipe filled: some sends had to wait
            reading.set()
            async with asyncio.timeout(20):
                await server
            assert received == [f"r{i}" for i in range(total)]
            assert not client._outbox
    finally:
        server.cancel()
        router.close(linger=0)


async def test_an_abort_refused_with_an_error_does_not_shift_later_aborts():
    async with (
        running_gateway(FakeEngine(), GatewayLimits(max_abort_ids=2)) as gw,
        AsyncClient(gw.addresses[0]) as client,
    ):
        with pytest.raises(RequestFailed) as info:
            await client.abort(["a", "b", "c"])
        assert info.value.code is ErrorCode.INVALID_MESSAGE
        async with asyncio.timeout(5):
            ack = await client.abort(["x"])
        assert ack.unknown == ["x"] and ack.aborted == []
        async with asyncio.timeout(5):
            ack = await client.abort(["y"])
        assert ack.unknown == ["y"]


async def test_a_dropped_stream_aborts_its_request_and_frees_its_id():
    engine = FakeEngine(step_interval_s=0.002)
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:
        never = client.generate([5], LONG, request_id="never")
        del never
        stream = client.generate([5], LONG, request_id="dropped")
        first = await stream.__anext__()
        assert first.request_id == "dropped"
        del stream
        gc.collect()
        async with asyncio.timeout(5):
            while engine.aborted != ["g2"] and engine.aborted != ["g1"]:
                await asyncio.sleep(0.01)
        assert len(engine.added) == 1  # the never-iterated stream sent nothing
        async with asyncio.timeout(5):
            while "dropped" in client._streams:  # reserved until its terminal arrives
                await asyncio.sleep(0.01)
        done = await client.complete([5], SamplingParams(max_tokens=3), request_id="dropped")
        assert done.output_tokens == 3


async def test_a_lagging_consumer_holds_bounded_outputs_and_loses_no_token():
    engine = FakeEngine(step_interval_s=0.0005)
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:
        sampling = SamplingParams(max_tokens=3000, ignore_eos=True)
        stream = client.generate([5], sampling, request_id="lag")
        tokens = list((await stream.__anext__()).new_token_ids)
        state = client._streams["lag"]
        peak = 0
        async with asyncio.timeout(20):
            while engine._live:  # the consumer does not read while the engine runs
                peak = max(peak, len(state.items))
                await asyncio.sleep(0.005)
        assert peak <= _MAX_PENDING_OUTPUTS + 1
        async for out in stream:
            tokens.extend(out.new_token_ids)
        assert tokens == [(5 + k) % 512 for k in range(3000)]


async def test_after_the_gateway_forgets_the_session_the_client_says_hello_again():
    async with running_gateway(FakeEngine()) as gw, AsyncClient(gw.addresses[0]) as client:
        assert (await client.complete([5], SamplingParams(max_tokens=2))).output_tokens == 2
        # The gateway expires the session (as after a stall longer than the timeout).
        await gw._apply(gw.table.expire(time.monotonic() + 1000))
        with pytest.raises(SessionLost) as info:
            await client.complete([5], SamplingParams(max_tokens=2))
        assert info.value.retryable
        done = await client.complete([5], SamplingParams(max_tokens=2))  # waits for the session
        assert done.output_tokens == 2 and client.sessions_opened == 2


async def test_a_pause_of_the_whole_process_ends_no_session():
    """Gateway and client share this process (as they share a machine that the host pauses
    or CPU-throttles): a pause longer than the heartbeat timeout is neither side's silence."""
    engine = FakeEngine(step_interval_s=0.002)
    async with (
        running_gateway(engine) as gw,
        AsyncClient(gw.addresses[0], heartbeat_interval_s=0.1) as client,
    ):
        timeout = client.hello_ack.heartbeat_timeout_s
        stream = client.generate([5], LONG, request_id="through")
        tokens = list((await anext(stream)).new_token_ids)
        time.sleep(timeout + 1.0)  # the whole process (gateway and client) stops running
        async with asyncio.timeout(10):
            while len(tokens) < 200:
                tokens.extend((await anext(stream)).new_token_ids)
        await asyncio.sleep(3 * timeout)  # and heartbeats carry on as before
        assert client.connected and client.sessions_opened == 1
        assert gw.table.stats.clients_expired == 0 and gw.table.stats.pauses_forgiven >= 1
        assert tokens[:200] == [(5 + k) % 512 for k in range(200)]
        await stream.aclose()


def test_the_blocking_client_times_out_and_aborts_the_request():
    engine = FakeEngine(step_interval_s=0.2)
    with (
        gateway_in_thread(engine) as gw,
        Client(gw.addresses[0], timeout_s=0.5) as client,
    ):
        with pytest.raises(TimeoutError):
            client.complete([5], LONG, request_id="slow")
        deadline = time.monotonic() + 5
        while not engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.aborted, "the timed-out request was not aborted"
        # Ctrl-C inside next() aborts the request too.
        previous = signal.signal(signal.SIGALRM, _raise_keyboard_interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                for _ in client.generate([6], LONG, request_id="interrupted"):
                    pass
        finally:
            signal.signal(signal.SIGALRM, previous)
        deadline = time.monotonic() + 5
        while len(engine.aborted) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(engine.aborted) == 2
        assert client.complete([5], SamplingParams(max_tokens=1)).output_tokens == 1


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def test_finished_with_an_unknown_reason_is_still_a_finished():
    fin = msgspec.msgpack.decode(msgspec.msgpack.encode([42, None, 1, 2, 0]), type=Finished)
    out = RequestOutput("r", [], fin)
    assert out.finished.finish_reason == 42 and out.finished.finish_reason is not FinishReason.STOP
    assert isinstance(Outputs([out]), Outputs)


def test_a_lagging_stream_merges_outputs_but_keeps_weight_version_changes_apart():
    from client.aio import _Stream

    state = _Stream(1)
    for k in range(_MAX_PENDING_OUTPUTS):
        state.push(RequestOutput("r", [k], None, None, None, 0, "v1" if k == 0 else None))
    state.push(RequestOutput("r", [100], None, None, None, 0, None))  # merged into the last
    state.push(RequestOutput("r", [200], None, None, None, 0, "v2"))  # new weights: kept apart
    state.push(RequestOutput("r", [201], None, None, None, 0, None))  # merged into the v2 one
    items = [slot.item for slot in state.items]
    assert len(items) == _MAX_PENDING_OUTPUTS + 1
    assert items[0].weight_version == "v1"
    assert items[-2].new_token_ids == [_MAX_PENDING_OUTPUTS - 1, 100]
    assert items[-2].weight_version is None
    assert items[-1].new_token_ids == [200, 201] and items[-1].weight_version == "v2"
