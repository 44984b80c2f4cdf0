"""GatewayPool against real gateway servers on fake engines: spreading, failover, abort
routing, and a gateway that comes up after the pool."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from client import (
    AsyncClient,
    FinishReason,
    GatewayPool,
    GatewayUnavailable,
    RequestFailed,
    SamplingParams,
    SessionLost,
)
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
            assert late_address in {s.gateway for s in streams}
            await pool.abort()
            for stream in streams:
                await stream_outcome(stream)


async def test_no_gateway_up_is_gateway_unavailable():
    pool = GatewayPool([ipc_address("none-a"), ipc_address("none-b")], connect_timeout_s=0.3)
    with pytest.raises(GatewayUnavailable):
        await pool.connect()


async def two_gateways_and_a_pool(stack: contextlib.AsyncExitStack, **limits):
    engines = [FakeEngine(step_interval_s=0.01) for _ in range(2)]
    gateways = [await stack.enter_async_context(running_gateway(e, **limits)) for e in engines]
    pool = await stack.enter_async_context(
        GatewayPool([g.addresses[0] for g in gateways], **FAST_HEARTBEAT)
    )
    return engines, gateways, pool


async def test_streams_left_early_or_refused_leave_no_count_behind():
    """100 loops left with ``break`` (no aclose) and refused requests: once their aborts
    land, nothing counts as in flight and the engines hold nothing."""
    async with contextlib.AsyncExitStack() as stack:
        engines, gateways, pool = await two_gateways_and_a_pool(stack)
        for i in range(100):
            async for _ in pool.generate([5 + i % 7], LONG):
                break
        with pytest.raises(RequestFailed):  # refused by the gateway: out of vocabulary
            await pool.complete([10**6], SHORT)
        async with asyncio.timeout(10):
            while any(pool.in_flight().values()) or any(e._live for e in engines):
                await asyncio.sleep(0.02)
        # Routing is even again: 4 new streams split 2 and 2.
        streams = await start_streams(pool, 4)
        assert sorted(pool.in_flight().values()) == [2, 2]
        await pool.abort()
        for stream in streams:
            await stream_outcome(stream)


async def test_a_request_id_live_anywhere_in_the_pool_is_refused_and_the_live_one_kept():
    async with contextlib.AsyncExitStack() as stack:
        engines, gateways, pool = await two_gateways_and_a_pool(stack)
        live = pool.generate([5], LONG, request_id="dup")
        await anext(live)
        for _ in range(3):  # whichever gateway each would go to
            with pytest.raises(ValueError, match="still live in this pool"):
                await anext(pool.generate([6], LONG, request_id="dup"))
        (ack,) = await pool.abort(["dup"])
        assert ack.aborted == ["dup"]
        assert await stream_outcome(live) is None
        assert sum(len(e._live) for e in engines) == 0
        # Once ended, the id may be used again.
        assert (await pool.complete([7], SHORT, request_id="dup")).output_tokens == 3


async def test_aborts_go_to_the_gateway_that_runs_each_request():
    async with contextlib.AsyncExitStack() as stack:
        engines, gateways, pool = await two_gateways_and_a_pool(stack)
        streams = await start_streams(pool, 4)
        by_gateway: dict[str, list[str]] = {}
        for stream in streams:
            by_gateway.setdefault(stream.gateway, []).append(stream.request_id)
        assert len(by_gateway) == 2
        acks = await pool.abort([s.request_id for s in streams])
        assert sorted(sorted(a.aborted) for a in acks) == sorted(
            sorted(ids) for ids in by_gateway.values()
        )
        assert all(not a.unknown for a in acks)
        for stream in streams:
            assert await stream_outcome(stream) is None
        assert [len(e._live) for e in engines] == [0, 0]


async def test_ties_rotate_over_the_gateways():
    async with contextlib.AsyncExitStack() as stack:
        engines, gateways, pool = await two_gateways_and_a_pool(stack)
        used = []
        for _ in range(6):
            stream = pool.generate([3], SHORT)
            async for _ in stream:
                pass
            used.append(stream.gateway)
        assert set(used) == {g.addresses[0] for g in gateways}
        assert used.count(used[0]) == 3


async def test_an_abort_with_one_gateway_gone_carries_out_the_others():
    async with contextlib.AsyncExitStack() as stack:
        engines = [FakeEngine(step_interval_s=0.01) for _ in range(2)]
        a = await stack.enter_async_context(running_gateway(engines[0]))
        inner = contextlib.AsyncExitStack()
        b = await inner.enter_async_context(running_gateway(engines[1]))
        pool = await stack.enter_async_context(
            GatewayPool([a.addresses[0], b.addresses[0]], **FAST_HEARTBEAT)
        )
        streams = await start_streams(pool, 4)
        await inner.aclose()  # b is gone; its client has not noticed yet
        acks = await pool.abort([s.request_id for s in streams])
        assert [sorted(x.aborted) for x in acks] == [
            sorted(s.request_id for s in streams if s.gateway == a.addresses[0])
        ]
        assert len(engines[0]._live) == 0
        for stream in streams:
            await stream_outcome(stream)


async def test_a_gateway_that_refuses_the_first_hello_is_retried_and_close_does_not_raise():
    from gateway.sessions import GatewayLimits

    full = GatewayLimits(max_clients=1)
    async with running_gateway(FakeEngine(step_interval_s=0.01), full) as a:
        squatter = AsyncClient(a.addresses[0])
        await squatter.connect()
        async with running_gateway(FakeEngine(step_interval_s=0.01)) as b:
            pool = GatewayPool([a.addresses[0], b.addresses[0]], **FAST_HEARTBEAT)
            await pool.connect()
            try:
                assert pool.connected == [b.addresses[0]]
                await squatter.aclose()  # a has room after the squatter's session expires
                async with asyncio.timeout(15):
                    while len(pool.connected) < 2:
                        await asyncio.sleep(0.05)
                streams = await start_streams(pool, 4)
                assert sorted(pool.in_flight().values()) == [2, 2]
                await pool.abort()
                for stream in streams:
                    await stream_outcome(stream)
            finally:
                await pool.aclose()  # must not raise the first refusal


async def test_with_the_cache_policy_a_prefix_held_by_two_gateways_goes_to_the_less_loaded():
    """Both gateways hold the prompt equally (their PrefixReplies say so): the one with
    fewer of this pool's requests in flight gets it, not the first listed."""
    from codec import PrefixReply

    engines = [FakeEngine(step_interval_s=0.01) for _ in range(2)]
    async with (
        running_gateway(engines[0]) as a,
        running_gateway(engines[1]) as b,
        GatewayPool([a.addresses[0], b.addresses[0]], policy="cache", **FAST_HEARTBEAT) as pool,
    ):

        async def both_hold_it(prompt, options=None):
            return PrefixReply(0, 16, [32], "cache")

        for client in pool.clients:
            client.prefix_query = both_hold_it
        busy = pool.generate([5], LONG)
        await anext(busy)
        first = busy.gateway
        other = b.addresses[0] if first == a.addresses[0] else a.addresses[0]
        for _ in range(3):
            stream = pool.generate([6], SHORT)
            async for _ in stream:
                pass
            assert stream.gateway == other  # the tie goes where nothing else runs
        await pool.abort()
        await stream_outcome(busy)
