"""A client always learns that its session is gone (issue 37 item 1), on real sockets: a
connection reset through a loopback proxy, a gateway restarted on the same address within
the heartbeat timeout, and a client whose loop was held past expiry. In each, the gateway
answers Pings all along, so silence never shows the loss: the Pong's session id does (or
the SESSION_EXPIRED terminal). Before, each left a request hanging with no output."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from client import AsyncClient, Client, GatewayUnavailable, SamplingParams, SessionLost
from gateway.fake_engine import FakeEngine
from tests.conftest import ipc_address, running_gateway
from tests.gateway.test_hardening import GatewayThread
from tests.helpers import stream_outcome
from tests.tcp_proxy import ResettingProxy

LONG = SamplingParams(max_tokens=10**7, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, ignore_eos=True)


async def test_a_connection_reset_mid_stream_ends_it_with_session_lost():
    """The proxy resets the TCP connection while a request streams: the gateway's next send
    fails (the client is unreachable) and it ends the session; ZeroMQ reconnects at once,
    Pongs come back, and their session id 0 fails the stream with SessionLost; the client
    says Hello again and serves on."""
    with (
        GatewayThread(address="tcp://127.0.0.1:0", step_interval_s=0.002) as gw,
        ResettingProxy(int(gw.address.rsplit(":", 1)[1])) as proxy,
    ):
        async with AsyncClient(
            proxy.address, heartbeat_interval_s=0.2, connect_timeout_s=10
        ) as client:
            stream = client.generate([5], LONG)
            await anext(stream)
            proxy.reset()
            async with asyncio.timeout(10):
                outcome = await stream_outcome(stream)
            assert isinstance(outcome, SessionLost), outcome
            assert "holds no session for this client" in str(outcome)
            # A new session, and requests through it.
            assert (await client.complete([6], SHORT)).output_tokens == 3
            assert client.sessions_opened == 2
            assert gw.call(lambda: gw.gateway.table.connected_clients) == 1


async def test_a_gateway_restarted_on_the_same_address_fails_the_old_streams_at_once(caplog):
    """The gateway is replaced within the heartbeat timeout (a supervisor's restart): the
    new one answers Pings, so the client never hears silence; the first Pong tells it the
    gateway holds no session for it (well before the 6 s timeout)."""
    address = ipc_address()
    client = AsyncClient(address, heartbeat_interval_s=2.0, connect_timeout_s=5)
    async with running_gateway(FakeEngine(step_interval_s=0.01), address=address):
        await client.connect()
        stream = client.generate([5], LONG)
        await anext(stream)
    try:
        async with running_gateway(FakeEngine(step_interval_s=0.01), address=address):
            restarted = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="engine_gateway.client"):
                async with asyncio.timeout(10):
                    outcome = await stream_outcome(stream)
            assert isinstance(outcome, SessionLost), outcome
            assert time.monotonic() - restarted < 5.0  # a Pong, not 6 s of silence
            assert "holds no session for this client any more" in caplog.text
            assert (await client.complete([6], SHORT)).output_tokens == 3
    finally:
        await client.aclose()


async def test_a_client_held_past_its_expiry_gets_session_lost_not_abort():
    """The client's own loop is held past its heartbeat timeout while the gateway (its own
    thread) runs: the gateway expires the session; when the client runs again, its stream
    ends with SessionLost (retryable), and it opens a new session."""
    with GatewayThread(step_interval_s=0.005) as gw:
        async with AsyncClient(gw.address, heartbeat_interval_s=0.1) as client:
            stream = client.generate([5], LONG)
            await anext(stream)
            time.sleep(1.0)  # the loop is held: no heartbeat (timeout 0.3 s)
            async with asyncio.timeout(10):
                outcome = await stream_outcome(stream)
            assert isinstance(outcome, SessionLost), outcome
            assert outcome.retryable and "session expired" in str(outcome)
            async with asyncio.timeout(10):
                while not client.connected:
                    await asyncio.sleep(0.01)
            assert (await client.complete([6], SHORT)).output_tokens == 3
            assert client.sessions_opened == 2


async def test_a_silent_gateway_fails_streams_after_the_heartbeat_timeout():
    """Silence itself still counts: with the gateway gone and nothing at its address, the
    stream fails with SessionLost once the timeout passed, not before, and not never."""
    address = ipc_address()
    async with running_gateway(FakeEngine(step_interval_s=0.01), address=address):
        client = AsyncClient(address, heartbeat_interval_s=0.2, reconnect_timeout_s=0.5)
        await client.connect()
        stream = client.generate([5], LONG)
        await anext(stream)
    try:
        stopped = time.monotonic()
        async with asyncio.timeout(10):
            outcome = await stream_outcome(stream)
        assert isinstance(outcome, SessionLost), outcome
        assert time.monotonic() - stopped < 5, "timeout is 0.6 s"
        assert "silent" in str(outcome)
        with pytest.raises(GatewayUnavailable):  # nobody there: bounded, not for ever
            await client.ping()
    finally:
        await client.aclose()


async def test_the_keeper_says_hello_until_a_gateway_answers():
    """A gateway that comes back after several seconds is found: Hellos go on, with
    backoff, for as long as the outage lasts."""
    address = ipc_address()
    client = AsyncClient(address, heartbeat_interval_s=0.1, reconnect_timeout_s=10)
    async with running_gateway(FakeEngine(), address=address):
        await client.connect()
    try:
        async with asyncio.timeout(10):
            while client.connected:
                await asyncio.sleep(0.01)
        await asyncio.sleep(2.5)  # the first Hellos go unanswered
        async with running_gateway(FakeEngine(), address=address):
            async with asyncio.timeout(10):
                done = await client.complete([6], SHORT)
            assert done.output_tokens == 3 and client.sessions_opened == 2
    finally:
        await client.aclose()


def test_ping_during_an_outage_ends_on_the_blocking_client_without_a_timeout():
    """``Client(timeout_s=None)``: a ping while no gateway is there ends (GatewayUnavailable
    after reconnect_timeout_s, or SessionLost), it does not wait for ever."""
    with GatewayThread() as gw:
        client = Client(
            gw.address, timeout_s=None, heartbeat_interval_s=0.1, reconnect_timeout_s=0.5
        )
    try:
        start = time.monotonic()
        with pytest.raises(GatewayUnavailable):  # SessionLost is one
            for _ in range(3):
                client.ping()
                time.sleep(0.2)
        assert time.monotonic() - start < 10
    finally:
        client.close()


def test_a_blocking_stream_closed_after_the_client_returns_at_once():
    with GatewayThread() as gw:
        client = Client(gw.address)
        outputs = client.generate([5], LONG)
        next(outputs)
        client.close()
        start = time.monotonic()
        outputs.close()
        assert time.monotonic() - start < 1.0


async def test_a_control_call_the_gateway_never_answers_ends_at_call_timeout_s():
    """Issue 48 item 3: AsyncClient control calls have a timeout of their own (the
    blocking client has 300 s): a Pause("wait") behind a request that never ends raises
    TimeoutError after call_timeout_s, and the client serves on."""
    from gateway.auth import ControlPolicy

    address = ipc_address()
    engine = FakeEngine(step_interval_s=0.01)
    open_control = ControlPolicy(open=True)
    async with (
        running_gateway(engine, address=address, control=open_control),
        AsyncClient(address, call_timeout_s=0.5) as client,
    ):
        stream = client.generate([5], LONG)
        await anext(stream)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="Pause .* within call_timeout_s"):
            await client.pause("wait")
        assert 0.4 < time.monotonic() - started < 5
        await stream.aclose()
        await client.resume()
        assert (await client.complete([6], SHORT)).output_tokens == 3
