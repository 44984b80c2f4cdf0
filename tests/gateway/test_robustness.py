"""One bad request, a bug, a slow reader or a dead engine never takes others down.

Real ROUTER over ipc:// with the fake engine; raw DEALER sockets count frames.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from client import AsyncClient, RequestFailed, RequestOverloaded, SamplingParams
from codec import (
    VERSION_FRAME,
    Error,
    ErrorCode,
    Generate,
    GetHealth,
    HealthReply,
    Hello,
    HelloAck,
    Outputs,
    Ping,
    encode,
)
from gateway.fake_engine import FakeEngine
from gateway.server import EXIT_ENGINE_DEAD
from gateway.sessions import GatewayLimits
from tests.conftest import running_gateway
from tests.gateway.test_hardening import GatewayThread, dealer, drain_until_pong, raw_session, recv

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


async def test_a_request_that_fails_to_submit_fails_alone():
    engine = FakeEngine()
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:
        engine.fail_submits = 1
        with pytest.raises(RequestFailed) as info:
            await client.complete([5], SHORT, request_id="bad")
        assert info.value.code is ErrorCode.INTERNAL
        assert info.value.request_id == "bad" and "refused to submit" in info.value.message
        assert (await client.complete([5], SHORT)).token_ids == [5, 6, 7, 8]
        assert gw.table.live_requests == 0 and gw.exit_code == 0


async def test_an_unexpected_failure_preparing_a_request_is_internal_for_it_alone():
    engine = FakeEngine()
    prepare = engine.prepare

    def buggy_prepare(engine_request_id, request):
        if request.prompt_token_ids == [13]:
            raise ZeroDivisionError("planted")
        return prepare(engine_request_id, request)

    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:
        gw.table._prepare = buggy_prepare
        with pytest.raises(RequestFailed) as info:
            await client.complete([13], SHORT, request_id="boom")
        assert info.value.code is ErrorCode.INTERNAL and info.value.request_id == "boom"
        assert "ZeroDivisionError" in info.value.message
        assert (await client.complete([5], SHORT)).output_tokens == 4


async def test_a_bug_while_handling_a_frame_answers_internal_and_the_loop_goes_on():
    async with running_gateway(FakeEngine()) as gw, AsyncClient(gw.addresses[0]) as client:
        on_message = gw.table.on_message

        def buggy(client_id, msg, now, key=None):
            if isinstance(msg, Ping) and msg.nonce == 13:
                raise KeyError("planted")
            return on_message(client_id, msg, now, key)

        gw.table.on_message = buggy
        client._send(Ping(13))
        async with asyncio.timeout(5):
            while not client.connection_errors:
                await asyncio.sleep(0.01)
        (error,) = client.connection_errors
        assert error.code is ErrorCode.INTERNAL and "KeyError" in error.message
        assert (await client.complete([5], SHORT)).output_tokens == 4


async def test_sessions_beyond_max_clients_are_refused_with_overloaded():
    async with (
        running_gateway(FakeEngine(), GatewayLimits(max_clients=2)) as gw,
        AsyncClient(gw.addresses[0]) as one,
        AsyncClient(gw.addresses[0]),
    ):
        with pytest.raises(RequestOverloaded) as info:
            async with AsyncClient(gw.addresses[0]):
                pass
        assert info.value.limit == "max_clients" and info.value.limit_value == 2
        assert (await one.complete([5], SHORT)).output_tokens == 4


def test_a_slow_consumer_gets_every_frame_owed_and_a_later_session_is_whole():
    """After SLOW_CONSUMER, every frame sent before and every terminal arrives, in order;
    Hello is refused until they are read; a later request's terminal is delivered."""
    limits = GatewayLimits(client_send_hwm=20)
    with GatewayThread(limits, step_interval_s=0.0005) as gw:
        slow = raw_session(gw.address, b"slow", RCVHWM=20, RCVBUF=4096)
        sampling = SamplingParams(max_tokens=100_000, ignore_eos=True)
        for i in range(10):
            slow.send_multipart(encode(Generate(f"s{i}", [7], True, sampling)))
        deadline = time.monotonic() + 20
        while gw.call(lambda: gw.gateway.table.stats.slow_consumers) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # Not read yet: a Hello now is refused (queued behind what is owed).
        slow.send_multipart(encode(Hello(1, "slow", 60.0)))
        tokens: dict[str, list[int]] = {f"s{i}": [] for i in range(10)}
        errors: dict[str, Error] = {}
        refused = None
        deadline = time.monotonic() + 20
        while refused is None:
            assert time.monotonic() < deadline
            msg = recv(slow)
            if isinstance(msg, Outputs):
                for out in msg.outputs:
                    assert out.request_id not in errors, "output after its terminal"
                    assert out.finished is None
                    tokens[out.request_id].extend(out.new_token_ids)
            elif isinstance(msg, Error) and msg.request_id is not None:
                assert msg.code is ErrorCode.SLOW_CONSUMER and "still delivered" in msg.message
                errors[msg.request_id] = msg
            elif isinstance(msg, Error):
                assert msg.code is ErrorCode.SLOW_CONSUMER
                refused = msg
        assert sorted(errors) == sorted(tokens)  # every request got its terminal
        for request_id, got in tokens.items():  # nothing lost before it: a gapless prefix
            assert got == [(7 + k) % 1000 for k in range(len(got))], request_id
        # Everything owed was read: a new session works, and its terminal arrives.
        deadline = time.monotonic() + 5
        while True:
            slow.send_multipart(encode(Hello(1, "slow", 60.0)))
            reply = recv(slow)
            if isinstance(reply, HelloAck):
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        slow.send_multipart(encode(Generate("later", [7], False, SamplingParams(max_tokens=5))))
        (done,) = [m for m in drain_until_pong_after(slow) if isinstance(m, Outputs)]
        assert done.outputs[0].finished.output_tokens == 5
        slow.close()


def drain_until_pong_after(sock: zmq.Socket, wait_s: float = 0.5) -> list:
    time.sleep(wait_s)
    return drain_until_pong(sock, 99)


def test_maximal_frames_are_refused_from_their_header_and_others_keep_being_served():
    limits = GatewayLimits(max_frame_bytes=8 * 1024 * 1024)
    with GatewayThread(limits) as gw:
        big = raw_session(gw.address, b"big", SNDHWM=0)
        payload = msgspec.msgpack.encode([2, "huge", [7] * 1_600_000])  # ~8 MiB of ids
        assert len(payload) < limits.max_frame_bytes
        for _ in range(10):
            big.send_multipart([VERSION_FRAME, payload])
        good = dealer(gw.address, b"good")
        start = time.perf_counter()
        good.send_multipart(encode(GetHealth(1)))
        assert isinstance(recv(good), HealthReply)
        replies = [recv(big, 10_000) for _ in range(10)]
        for reply in replies:
            assert reply.code is ErrorCode.INVALID_REQUEST and reply.request_id == "huge"
            assert "max_prompt_tokens (4096)" in reply.message
        assert time.perf_counter() - start < 10
        big.close()
        good.close()


async def test_after_engine_death_health_and_refusals_are_served_then_exit_3():
    engine = FakeEngine(step_interval_s=0.01)
    async with running_gateway(engine, engine_dead_grace_s=1.0) as gw:
        async with AsyncClient(gw.addresses[0]) as client:
            live = asyncio.ensure_future(client.complete([5], SamplingParams(max_tokens=10**5)))
            await asyncio.sleep(0.1)
            engine.kill()
            with pytest.raises(RequestFailed) as info:
                await live
            assert info.value.code is ErrorCode.ENGINE_DEAD
            health = await client.health()
            assert health.state == "engine_dead" and not health.ready
            with pytest.raises(RequestFailed) as info:
                await client.complete([5], SHORT)
            assert info.value.code is ErrorCode.ENGINE_DEAD
            async with asyncio.timeout(5):
                while not gw._stop.is_set():
                    await asyncio.sleep(0.05)
        assert gw.exit_code == EXIT_ENGINE_DEAD
