"""GatewayPool against real gateway servers on fake engines: spreading, failover, abort
routing, and a gateway that comes up after the pool."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from client import FinishReason, GatewayPool, GatewayUnavailable, SamplingParams, SessionLost
from gateway.fake_engine import FakeEngine
from tests.conftest import ipc_address, running_gateway
from tests.helpers import stream_outcome

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, ignore_eos=True)
FAST_HEARTBEAT = dict(heartbeat_interval_s=0.1, connect_timeout_s=5, reconnect_timeout_s=2)


async def start_streams(pool: GatewayPool, count: int) -> list:
    """``count`` long streams, each past its first output."""
    streams = [pool.generate([5 + i], LONG) for i in range(count)]
    for stream in streams:
        await anext(stream)
    return streams


async def test_requests_spread_over_the_gateways_by_least_in_flight():
    engines = [FakeEngine(step_interval_s=0.01) for _ in range(2)]
    async with (
        running_gateway(engines[0]) as a,
        running_gateway(engines[1]) as b,
        GatewayPool([a.addresses[0], b.addresses[0]], **FAST_HEARTBEAT) as pool,
    ):
        streams = await start_streams(pool, 6)
        assert pool.in_flight() == {a.addresses[0]: 3, b.addresses[0]: 3}
        assert [len(e._live) for e in engines] == [3, 3]
        # Finish the three on one gateway: the next three all go to the other.
        on_a = [s for s in streams if s.gateway == a.addresses[0]]
        await pool.abort([s.request_id for s in on_a])
        for stream in on_a:
            assert await stream_outcome(stream) is None
        assert pool.in_flight() == {a.addresses[0]: 0, b.addresses[0]: 3}
        more = await start_streams(pool, 3)
        assert {s.gateway for s in more} == {a.addresses[0]}
        await pool.abort()
        for stream in streams + more:
            await stream_outcome(stream)
        assert pool.in_flight() == {a.addresses[0]: 0, b.addresses[0]: 0}
        health = await pool.health()
        assert [h.live_requests for h in health.values()] == [0, 0]


async def test_a_lost_gateway_fails_its_requests_retryably_and_new_ones_go_elsewhere():
    engines = [FakeEngine(step_interval_s=0.01) for _ in range(2)]
    async with running_gateway(engines[0]) as a:
        stack = contextlib.AsyncExitStack()
        b = await stack.enter_async_context(running_gateway(engines[1]))
        async with GatewayPool([a.addresses[0], b.addresses[0]], **FAST_HEARTBEAT) as pool:
            streams = await start_streams(pool, 4)
            await stack.aclose()  # gateway b stops (and never answers again)
            results = await asyncio.gather(
                *(stream_outcome(s) for s in streams if s.gateway == b.addresses[0])
            )
            assert len(results) == 2
            assert all(isinstance(r, SessionLost) and r.retryable for r in results)
            assert pool.connected == [a.addresses[0]]
            done = [await pool.complete([7], SHORT) for _ in range(4)]
            assert all(d.finish_reason is FinishReason.LENGTH for d in done)
            assert pool.in_flight()[b.addresses[0]] == 0
            await pool.abort()
            for stream in streams:
                await stream_outcome(stream)


async def test_a_gateway_that_starts_later_joins_the_pool():
    late_address = ipc_address("late")
    async with (
        running_gateway(FakeEngine(step_interval_s=0.01)) as a,
        GatewayPool([a.addresses[0], late_address], **FAST_HEARTBEAT) as pool,
    ):
        assert pool.connected == [a.addresses[0]]
        assert (await pool.complete([3], SHORT)).output_tokens == 3
        async with running_gateway(FakeEngine(step_interval_s=0.01), address=late_address):
            async with asyncio.timeout(10):
                while len(pool.connected) < 2:
                    await asyncio.sleep(0.02)
            streams = await start_streams(pool, 4)
            assert sorted(pool.in_flight().values()) == [2, 2]
            await pool.abort()
            for stream in streams:
                await stream_outcome(stream)


async def test_no_gateway_up_is_gateway_unavailable():
    pool = GatewayPool([ipc_address("none-a"), ipc_address("none-b")], connect_timeout_s=0.3)
    with pytest.raises(GatewayUnavailable):
        await pool.connect()
