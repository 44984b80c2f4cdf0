"""client.any_loop: a pool made with no event loop running, used under one asyncio.run after
another (as SkyRL uses its inference client), against a gateway on the fake engine served
from a thread of its own (tests.conftest.gateway_in_thread)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from client import SamplingParams
from client.any_loop import pool_on_own_loop
from client.errors import GatewayUnavailable
from gateway.auth import ControlPolicy
from gateway.fake_engine import FakeEngine
from tests.conftest import gateway_in_thread, ipc_address

LONG = SamplingParams(max_tokens=10_000, ignore_eos=True)


def test_a_pool_on_its_own_loop_serves_calls_from_one_loop_after_another():
    engine = FakeEngine(step_interval_s=0.01)
    with gateway_in_thread(engine, control=ControlPolicy(open=True)) as gateway:
        address = gateway.addresses[0]
        pool = pool_on_own_loop(address, name="any-loop")  # no loop running here
        try:
            first = asyncio.run(pool.complete([5, 6], SamplingParams(max_tokens=3)))
            second = asyncio.run(pool.complete([7], SamplingParams(max_tokens=2)))
            assert (first.output_tokens, second.output_tokens) == (3, 2)
            (gateway,) = pool.clients
            assert gateway.connected and pool.connected == [address]
            assert asyncio.run(gateway.pause("keep")).operation == "pause"
            assert asyncio.run(gateway.resume()).operation == "resume"

            async def cancelled_midway() -> None:
                started = len(engine.added)
                call = asyncio.ensure_future(pool.complete([8], LONG))
                while len(engine.added) == started:
                    await asyncio.sleep(0.01)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call

            asyncio.run(asyncio.wait_for(cancelled_midway(), 10))
            deadline = time.monotonic() + 5
            while not engine.aborted and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.aborted == engine.added[-1:]  # the caller's cancel reached it
            with pytest.raises(AttributeError, match="not a coroutine method"):
                pool.generate([5])  # a stream would run on the caller's loop
        finally:
            pool.close()
        assert not any(t.name == "gateway-pool-loop" for t in threading.enumerate())


def test_no_gateway_answers_within_the_connect_timeout():
    before = threading.active_count()
    with pytest.raises(GatewayUnavailable):
        pool_on_own_loop(ipc_address(), connect_timeout_s=0.3)
    assert threading.active_count() == before  # its loop's thread is gone


def test_calls_after_close_raise_at_once_and_close_is_idempotent():
    """Issue 77 item 5: after close() or aclose(), every call raises GatewayUnavailable at
    once (as a closed AsyncClient's), a second close does nothing, and the loop is closed
    (its file descriptors released, not left for the collector)."""
    import os

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    engine = FakeEngine(step_interval_s=0.01)
    with gateway_in_thread(engine, control=ControlPolicy(open=True)) as gateway:
        address = gateway.addresses[0]
        before = descriptors()
        for closing in ("close", "aclose"):
            pool = pool_on_own_loop(address, name=f"after-{closing}")
            assert asyncio.run(pool.complete([5], SamplingParams(max_tokens=2))).output_tokens == 2
            if closing == "close":
                pool.close()
                pool.close()
            else:

                async def twice(pool=pool) -> None:  # noqa: ANN001
                    await pool.aclose()
                    await pool.aclose()

                asyncio.run(asyncio.wait_for(twice(), 10))
            assert pool._loop.is_closed()

            async def calls(pool=pool) -> None:  # noqa: ANN001
                with pytest.raises(GatewayUnavailable):
                    await pool.complete([5], SamplingParams(max_tokens=2))
                (client,) = pool.clients
                with pytest.raises(GatewayUnavailable):
                    await client.health()

            asyncio.run(asyncio.wait_for(calls(), 5))
        deadline = time.monotonic() + 5
        while descriptors() > before and time.monotonic() < deadline:
            time.sleep(0.05)  # the sockets' own closing (zmq's reaper) may lag a little
        assert descriptors() <= before
