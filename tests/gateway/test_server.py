"""The server over a real ROUTER socket (ipc://) with the in-process fake engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import msgspec
import pytest
import zmq
import zmq.asyncio

from client import AsyncClient, FinishReason, RequestFailed, RequestOverloaded, SamplingParams
from codec import (
    Error,
    ErrorCode,
    Hello,
    Outputs,
    decode_server,
    encode,
)
from gateway.fake_engine import FakeEngine
from gateway.server import EXIT_ENGINE_DEAD, EXIT_OK
from gateway.sessions import GatewayLimits
from tests.conftest import running_gateway
from tests.helpers import TerminalLedger


async def raw_dealer(address: str, identity: bytes = b"raw") -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


async def recv(sock: zmq.asyncio.Socket, timeout: float = 5.0):
    async with asyncio.timeout(timeout):
        return decode_server(await sock.recv_multipart())


async def test_streams_and_completes_through_the_socket():
    async with running_gateway(FakeEngine()) as gw, AsyncClient(gw.addresses[0]) as client:
        outs = [o async for o in client.generate([5, 6], SamplingParams(max_tokens=4))]
        assert [o.new_token_ids[0] for o in outs] == [11, 12, 13, 14]
        assert outs[-1].finished.finish_reason is FinishReason.LENGTH
        done = await client.complete([5, 6], SamplingParams(max_tokens=4))
        assert done.token_ids == [11, 12, 13, 14] and done.output_tokens == 4


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([b"\x01"], ErrorCode.BAD_FRAME_COUNT),
        ([b"\x07", b"\x90"], ErrorCode.UNSUPPORTED_VERSION),
        ([b"\x01", b"\xc1\xc1"], ErrorCode.MALFORMED),
        ([b"\x01", msgspec.msgpack.encode([42])], ErrorCode.UNKNOWN_MESSAGE),
        ([b"\x01", msgspec.msgpack.encode([2, "bad", [-1]])], ErrorCode.INVALID_MESSAGE),
        ([b"\x01", b"\x00" * 2000], ErrorCode.FRAME_TOO_LARGE),
    ],
)
async def test_bad_frames_get_their_error_and_others_are_still_served(frames, code):
    limits = GatewayLimits(max_frame_bytes=1000)
    async with running_gateway(FakeEngine(), limits) as gw, AsyncClient(gw.addresses[0]) as good:
        bad = await raw_dealer(gw.addresses[0])
        try:
            await bad.send_multipart(frames)
            err = await recv(bad)
            assert isinstance(err, Error) and err.code is code
            done = await good.complete([10], SamplingParams(max_tokens=3))
            assert done.output_tokens == 3
        finally:
            bad.close()


async def test_many_concurrent_requests_from_clients_sharing_request_ids():
    async def run(client, i, max_tokens):
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return await client.complete([i], sampling, request_id=f"q{i}")

    async with (
        running_gateway(FakeEngine()) as gw,
        AsyncClient(gw.addresses[0]) as a,
        AsyncClient(gw.addresses[0]) as b,
    ):
        results = await asyncio.gather(
            *[run(a, i, 3) for i in range(40)], *[run(b, i, 5) for i in range(40)]
        )
    for k, done in enumerate(results):
        i, expected_len = (k, 3) if k < 40 else (k - 40, 5)
        assert done.request_id == f"q{i}"
        assert done.token_ids == [(i + j) % 512 for j in range(expected_len)]


async def test_leaving_the_loop_early_aborts_the_request_in_the_engine():
    engine = FakeEngine(step_interval_s=0.005)
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:
        async for _ in client.generate([1], SamplingParams(max_tokens=1000, ignore_eos=True)):
            break
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["g" + engine.added[-1][1:]]
        assert gw.table.live_requests == 0


async def test_cancelling_the_consumer_task_aborts_the_request():
    engine = FakeEngine(step_interval_s=0.005)
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:

        async def consume():
            async for _ in client.generate([1], SamplingParams(max_tokens=10_000, ignore_eos=True)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == engine.added


async def test_overloaded_reply_raises_request_overloaded():
    engine = FakeEngine(step_interval_s=0.01)
    limits = GatewayLimits(max_in_flight_per_client=1)
    async with running_gateway(engine, limits) as gw, AsyncClient(gw.addresses[0]) as client:
        first = client.generate([1], SamplingParams(max_tokens=50, ignore_eos=True))
        await first.__anext__()
        with pytest.raises(RequestOverloaded) as info:
            await client.complete([1])
        assert info.value.limit == "max_in_flight_per_client" and info.value.current == 1
        await first.aclose()


async def test_validation_errors_raise_request_failed_with_the_code():
    async with running_gateway(FakeEngine()) as gw, AsyncClient(gw.addresses[0]) as client:
        with pytest.raises(RequestFailed) as info:
            await client.complete([9999])
        assert info.value.code is ErrorCode.INVALID_REQUEST


async def test_a_silent_client_is_expired_and_its_requests_aborted():
    engine = FakeEngine(step_interval_s=0.01)
    async with running_gateway(engine) as gw:
        sock = await raw_dealer(gw.addresses[0], b"silent")
        try:
            await sock.send_multipart(encode(Hello(1, "silent", 0.1)))
            ack = await recv(sock)
            assert ack.heartbeat_timeout_s == pytest.approx(0.3)
            from codec import Generate

            await sock.send_multipart(
                encode(
                    Generate("r1", [1], sampling=SamplingParams(max_tokens=10_000, ignore_eos=True))
                )
            )
            await recv(sock)
            for _ in range(200):  # never sends again: expired after 0.3 s
                if engine.aborted:
                    break
                await asyncio.sleep(0.01)
            assert engine.aborted == engine.added
            assert gw.table.connected_clients == 0
        finally:
            sock.close()


async def test_engine_death_ends_every_request_with_engine_dead_and_exits_nonzero():
    engine = FakeEngine(step_interval_s=0.01)
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:

        async def one(i):
            with pytest.raises(RequestFailed) as info:
                async for _ in client.generate(
                    [i], SamplingParams(max_tokens=10_000, ignore_eos=True)
                ):
                    pass
            return info.value.code

        tasks = [asyncio.ensure_future(one(i)) for i in range(5)]
        await asyncio.sleep(0.1)
        engine.kill()
        codes = await asyncio.gather(*tasks)
        assert codes == [ErrorCode.ENGINE_DEAD] * 5
        assert gw.exit_code == EXIT_ENGINE_DEAD


async def test_drain_lets_live_requests_finish_refuses_new_ones_and_exits_zero():
    engine = FakeEngine(step_interval_s=0.005)
    async with (
        running_gateway(engine, drain_timeout_s=10) as gw,
        AsyncClient(gw.addresses[0]) as client,
    ):
        stream = client.generate([1], SamplingParams(max_tokens=20, ignore_eos=True))
        first = await stream.__anext__()
        gw.drain()
        with pytest.raises(RequestFailed) as info:
            await client.complete([2])
        assert info.value.code is ErrorCode.DRAINING
        rest = [o async for o in stream]
        assert len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest) == 20
        assert rest[-1].finished.finish_reason is FinishReason.LENGTH
        for _ in range(100):
            if gw._stop.is_set():
                break
            await asyncio.sleep(0.01)
        assert gw._stop.is_set() and gw.exit_code == EXIT_OK


async def test_drain_deadline_aborts_what_is_left_with_terminal_outputs():
    engine = FakeEngine(step_interval_s=0.01)
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:
        stream = client.generate([1], SamplingParams(max_tokens=100_000, ignore_eos=True))
        await stream.__anext__()
        gw.drain(timeout_s=0.1)
        outs = [o async for o in stream]
        assert outs[-1].finished.finish_reason is FinishReason.ABORT
        assert engine.aborted == engine.added


async def test_raw_client_sees_one_terminal_per_request_under_mixed_aborts():
    engine = FakeEngine(step_interval_s=0.002)
    async with running_gateway(engine) as gw:
        sock = await raw_dealer(gw.addresses[0], b"ledger")
        ledger = TerminalLedger()
        from codec import Abort, Generate

        try:
            await sock.send_multipart(encode(Hello(1, "ledger", 5.0)))
            await recv(sock)
            for i in range(30):
                await sock.send_multipart(
                    encode(
                        Generate(
                            f"r{i}",
                            [i + 1],
                            i % 2 == 0,
                            SamplingParams(max_tokens=5 + i, ignore_eos=True),
                        )
                    )
                )
                ledger.submitted(b"ledger", f"r{i}")
                if i % 3 == 0:
                    await sock.send_multipart(encode(Abort([f"r{i}", f"r{i - 1}"])))
            acks = 0
            while acks < 10 or ledger.current:
                msg = await recv(sock)
                ledger.observe(b"ledger", msg)
                acks += type(msg).__name__ == "AbortAck"
            ledger.assert_complete()
            assert not isinstance(msg, Outputs) or msg.outputs
        finally:
            sock.close()


def test_freezing_the_startup_heap_leaves_the_collector_only_what_serving_allocates():
    # In a child process: freezing is process-wide.
    code = (
        "import gc, json\n"
        "from gateway.server import freeze_startup_heap\n"
        "before = len(gc.get_objects())\n"
        "freeze_startup_heap()\n"
        "print(json.dumps([before, gc.get_freeze_count(), len(gc.get_objects())]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    before, frozen, tracked = json.loads(done.stdout)
    assert before > 10_000  # the gateway's imports
    assert frozen >= before * 0.9 and tracked < 1_000


async def test_a_client_that_closes_says_goodbye_and_is_never_counted_as_expired():
    """Issue 72 item 4: closing an AsyncClient ends its session at the gateway at once (its
    live request aborted in the engine), with no expiry warning or count afterwards."""
    engine = FakeEngine(step_interval_s=0.01)
    async with running_gateway(engine) as gw:
        async with AsyncClient(gw.addresses[0], heartbeat_interval_s=0.2) as client:
            stream = client.generate([5], SamplingParams(max_tokens=10**6, ignore_eos=True))
            await stream.__anext__()  # live in the engine
        async with asyncio.timeout(5):
            while gw.table.stats.clients_left < 1 or gw.table.live_requests:
                await asyncio.sleep(0.01)
        assert gw.table.connected_clients == 0
        await asyncio.sleep(1.0)  # past the 0.6 s heartbeat timeout it would have had
        assert gw.table.stats.clients_expired == 0 and gw.table.stats.clients_left == 1
