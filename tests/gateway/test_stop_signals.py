"""Stop signals before serving (gateway/stop_signals.py), on a real uvloop, no engine.

The case that made a group's gateway miss its supervisor's SIGTERM: the signal arrives
while the loop waits (for the engines), uvloop runs the Python handler in its own callback,
and the handler's raise is logged and dropped there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time

import pytest
import uvloop

from gateway.stop_signals import StopRequested, stop_while_starting, stoppable_start


@pytest.fixture
def sigterm_stops_the_start():
    previous = signal.getsignal(signal.SIGTERM)
    restore = stop_while_starting((signal.SIGTERM,))
    try:
        yield
    finally:
        restore()
        assert signal.getsignal(signal.SIGTERM) is previous


def _sigterm_from_a_thread(after_s: float) -> threading.Timer:
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_a_sigterm_while_the_loop_waits_stops_the_start(sigterm_stops_the_start, caplog):
    async def start() -> None:
        async with stoppable_start():
            await asyncio.sleep(30)  # an engine that takes its time

    timer = _sigterm_from_a_thread(0.2)
    began = time.monotonic()
    with caplog.at_level(logging.ERROR), pytest.raises(StopRequested) as stop:
        uvloop.run(start())
    timer.join()
    assert time.monotonic() - began < 5
    assert stop.value.signum == signal.SIGTERM
    assert not [r for r in caplog.records if "StopRequested" in r.getMessage()], caplog.text


def test_a_sigterm_in_blocking_start_up_code_stops_it_too(sigterm_stops_the_start):
    async def start() -> None:
        async with stoppable_start():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a blocking handshake, the loop not running
                time.sleep(0.01)

    timer = _sigterm_from_a_thread(0.2)
    began = time.monotonic()
    with pytest.raises(StopRequested):
        uvloop.run(start())
    timer.join()
    assert time.monotonic() - began < 5


def test_without_a_signal_the_start_ends_and_other_cancels_stay_cancels(sigterm_stops_the_start):
    async def start() -> str:
        async with stoppable_start():
            await asyncio.sleep(0.01)
        return "started"

    assert uvloop.run(start()) == "started"

    async def cancelled() -> None:
        task = asyncio.current_task()
        asyncio.get_running_loop().call_later(0.05, task.cancel)
        async with stoppable_start():
            await asyncio.sleep(30)

    with pytest.raises(asyncio.CancelledError):
        uvloop.run(cancelled())


def test_a_signal_as_the_start_ends_is_not_lost(sigterm_stops_the_start):
    """The handler ran (its raise lost in a loop callback) but the block ended before the
    cancel was delivered: the block's end raises it."""

    async def start() -> None:
        loop = asyncio.get_running_loop()
        async with stoppable_start():
            # The signal lands in a loop callback; the block ends in the same loop turn.
            loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)
            await asyncio.sleep(0)

    with pytest.raises(StopRequested):
        uvloop.run(start())
