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
  once (``StopRequested``): exit status 0, nothing left running.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any

__all__ = [
    "IGNORE_SIGINT_ENV",
    "StopRequested",
    "ignore_terminal_interrupt",
    "stop_while_starting",
]

IGNORE_SIGINT_ENV = "ENGINE_GATEWAY_ENGINES_IGNORE_SIGINT"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """SIGTERM or SIGINT arrived before the gateway served: stop starting."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, _frame: Any) -> None:
    raise StopRequested(signum)


def stop_while_starting(signals: tuple[int, ...] = _STOP_SIGNALS) -> Callable[[], None]:
    """Until the returned function is called (it restores the previous handlers), these
    signals raise ``StopRequested`` in the main thread, out of any blocking start-up."""
    os.environ[IGNORE_SIGINT_ENV] = "1"  # the engines started from now on
    previous = {signum: signal.signal(signum, _raise_stop) for signum in signals}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def ignore_terminal_interrupt() -> bool:
    """In a child process started under a serving gateway (the env mark), ignore SIGINT;
    whether it did. The vLLM plugin calls it in vLLM's processes."""
    if os.environ.get(IGNORE_SIGINT_ENV) != "1" or multiprocessing.parent_process() is None:
        return False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return True
