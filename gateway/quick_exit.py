"""Ending a process whose work is done without the interpreter's teardown.

A process that has imported vLLM, torch and transformers spends about 2 s of CPU (on the
2-core VM, py-spy: ``gc_collect_main``) in the interpreter's teardown, collecting garbage
over every object of those libraries more than once, and then native extensions report
objects they consider leaked (triton's nanobind: hundreds of stderr lines). The kernel
takes back the memory either way. ``exit_now`` runs the exit handlers (``atexit``: logging,
temporary files, multiprocessing's resource tracker), flushes Python's and C's standard
streams, and ends the process with its status; ``end_spawned_process_quickly`` does so
for a multiprocessing child once its work is over. No vLLM import here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing.spawn
import os
import sys
from typing import NoReturn

__all__ = ["end_spawned_process_quickly", "exit_now"]


def exit_now(status: object = None) -> NoReturn:
    """End this process as ``sys.exit(status)`` would, less the interpreter's teardown:
    what ``__del__`` of objects still alive would have done is not done (Python never
    promises it at exit)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # C stdio, which native code writes to
        ctypes.CDLL(None).fflush(None)
    os._exit(_exit_code(status))


def _exit_code(status: object) -> int:
    """The exit status ``sys.exit(status)`` gives: None is 0, an int itself, anything
    else 1 (printed to stderr, as Python does)."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    with contextlib.suppress(Exception):
        print(status, file=sys.stderr, flush=True)
    return 1


_SPAWN_MAIN = multiprocessing.spawn.spawn_main.__code__


def end_spawned_process_quickly() -> None:
    """In a process multiprocessing spawned: end it with ``exit_now`` at multiprocessing's
    own last ``sys.exit`` (its target returned, its finalizers and non-daemon threads done,
    the exit status known). Every other ``sys.exit`` behaves as before."""
    system_exit = sys.exit
    if getattr(system_exit, "quick_exit", False):
        return

    def exit_(status: object = None) -> None:
        if sys._getframe(1).f_code is _SPAWN_MAIN:
            exit_now(status)
        system_exit(status)

    exit_.quick_exit = True  # type: ignore[attr-defined]
    sys.exit = exit_
