"""End a child process once the process that started it is gone (SIGKILL, OOM kill, crash).

vLLM's EngineCore does not watch its parent (vLLM issue #55510): when the process that
started it dies without running its shutdown, the engine lives on, orphaned, holding its
accelerator memory and KV cache, so a restarted gateway finds the memory taken.
The same holds for vLLM's DP coordinator and for the gateway processes of
``serve --gateway-count N`` when their supervisor is killed. ``watch_parent`` runs a daemon
thread in the child that waits for its parent to be gone, then signals the child to stop
(SIGTERM, which vLLM's engine handles by aborting its requests and shutting down; a group's
gateway takes SIGUSR1, "the engines are gone"), and kills it if it has not ended after a
grace period.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import connection

__all__ = ["PARENT_POLL_S", "STOP_GRACE_S", "parent_gone", "watch_parent"]

PARENT_POLL_S = 1.0  # how often the parent pid is compared, beside the sentinel's wait
STOP_GRACE_S = 30.0  # from SIGTERM to SIGKILL
logger = logging.getLogger(__name__)


def watch_parent(
    signum: int = signal.SIGTERM, poll_s: float = PARENT_POLL_S, grace_s: float = STOP_GRACE_S
) -> threading.Thread | None:
    """In a process started by ``multiprocessing`` (spawn, fork or forkserver), start a
    daemon thread that, once the parent is gone, sends ``signum`` to this process and
    SIGKILL ``grace_s`` later; None (and no thread) in a process multiprocessing did not
    start."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return None
    thread = threading.Thread(
        target=_stop_when_gone,
        args=(parent, os.getppid(), signum, poll_s, grace_s),
        name="engine-gateway-parent-watch",
        daemon=True,
    )
    thread.start()
    return thread


def parent_gone(
    parent: multiprocessing.process.BaseProcess, ppid: int, timeout: float = 0.0
) -> bool:
    """Whether ``parent`` (this process's multiprocessing parent; ``ppid``: this process's
    parent pid while it lived) has exited, waiting up to ``timeout`` for it. Its sentinel
    closes when it exits, but also stays open while a process it forked later still holds
    it; the parent pid changes when this process is reparented. Either one tells; the
    sentinel tells at once."""
    return os.getppid() != ppid or bool(connection.wait([parent.sentinel], timeout=timeout))


def _stop_when_gone(
    parent: multiprocessing.process.BaseProcess,
    ppid: int,
    signum: int,
    poll_s: float,
    grace_s: float,
) -> None:
    while not parent_gone(parent, ppid, poll_s):
        pass
    logger.warning(
        "the process that started this one (pid %d) is gone: stopping (%s, then SIGKILL "
        "after %g s)",
        parent.pid,
        signal.Signals(signum).name,
        grace_s,
    )
    os.kill(os.getpid(), signum)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
