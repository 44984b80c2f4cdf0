"""How the gateway's processes take SIGTERM and a terminal's Ctrl-C (SIGINT).

A terminal sends Ctrl-C to its whole foreground process group: the gateway (or the
``--gateway-count`` supervisor), its gateways, vLLM's engines, workers and DP coordinator.
Only the process the operator started may act on it, by draining: the engines stopped
outright on it (every request ENGINE_DEAD, exit 3), and group gateways took it as a second
interrupt after the supervisor's SIGTERM (stop at once, no drain). So:

- the serving process sets ``IGNORE_SIGINT_ENV`` before it starts engines; the vLLM
  plugin then ignores SIGINT in the vLLM processes started under it
  (``ignore_terminal_interrupt``), which stop when the gateway stops them (SIGTERM) or
  when it is gone (``parent_watch``);
- a group's gateways ignore SIGINT; their supervisor forwards a drain (SIGTERM);
- before it serves (engine start-up takes ~30 s), SIGTERM or SIGINT stops the start at
  once (``StopRequested``): exit status 0, nothing left running. Inside an event loop the
  handler's raise is lost when the loop itself runs it (uvloop's signal processing, while
  the loop waits for the engines, logs and drops it); the awaits of a start therefore run
  under ``stoppable_start``, which cancels them on the signal and raises ``StopRequested``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

__all__ = [
    "IGNORE_SIGINT_ENV",
    "StopRequested",
    "ignore_terminal_interrupt",
    "stop_while_starting",
    "stoppable_start",
]

IGNORE_SIGINT_ENV = "ENGINE_GATEWAY_ENGINES_IGNORE_SIGINT"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """SIGTERM or SIGINT arrived before the gateway served: stop starting."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_requested: list[int] = []  # the stop signals that arrived since stop_while_starting
_start_task: asyncio.Task | None = None  # the task in stoppable_start, if any


def _raise_stop(signum: int, _frame: Any) -> None:
    _requested.append(signum)
    task = _start_task
    if task is not None and not task.done():
        # Run by the loop's own signal processing, the raise below is logged and dropped:
        # cancel the start as well (a no-op if the raise reached it first).
        task.get_loop().call_soon_threadsafe(_cancel_start)
    raise StopRequested(signum)


def _cancel_start() -> None:
    if _start_task is not None:
        _start_task.cancel()


def stop_while_starting(signals: tuple[int, ...] = _STOP_SIGNALS) -> Callable[[], None]:
    """Until the returned function is called (it restores the previous handlers), these
    signals raise ``StopRequested`` in the main thread, out of any blocking start-up."""
    os.environ[IGNORE_SIGINT_ENV] = "1"  # the engines started from now on
    _requested.clear()
    previous = {signum: signal.signal(signum, _raise_stop) for signum in signals}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


@contextlib.asynccontextmanager
async def stoppable_start() -> AsyncIterator[None]:
    """Around the awaits of a start-up under ``stop_while_starting``: a stop signal that
    arrives while the loop waits raises ``StopRequested`` here, as it would in blocking
    code (the loop's log of the lost raise is kept quiet)."""
    global _start_task
    task = asyncio.current_task()
    assert task is not None, "stoppable_start runs in a task"
    loop = task.get_loop()
    previous_handler = loop.get_exception_handler()

    def quiet_lost_stop(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if isinstance(context.get("exception"), StopRequested):
            return  # the start is cancelled instead
        if previous_handler is not None:
            previous_handler(loop, context)
        else:
            loop.default_exception_handler(context)

    _start_task = task
    loop.set_exception_handler(quiet_lost_stop)
    try:
        yield
    except asyncio.CancelledError:
        if not _requested:
            raise
        task.uncancel()
        raise StopRequested(_requested[0]) from None
    finally:
        _start_task = None
        loop.set_exception_handler(previous_handler)
    if _requested:  # arrived as the block ended, its cancel not yet delivered
        raise StopRequested(_requested[0])


def ignore_terminal_interrupt() -> bool:
    """In a child process started under a serving gateway (the env mark), ignore SIGINT;
    whether it did. The vLLM plugin calls it in vLLM's processes."""
    if os.environ.get(IGNORE_SIGINT_ENV) != "1" or multiprocessing.parent_process() is None:
        return False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True
