"""process_exit.exit_status on real child processes: running, exited or killed but not yet
reaped, and one whose main thread has exited while another thread keeps its pipes open
(as a killed engine's last thread did for 25 s, stuck in the kernel's memory teardown)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import connection

import pytest

from gateway.process_exit import exit_status
from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
SPAWN = multiprocessing.get_context("spawn")


def sleep_forever() -> None:
    time.sleep(600)


def exit_with_3() -> None:
    os._exit(3)


def main_thread_exits_while_a_thread_lingers() -> None:
    threading.Thread(target=time.sleep, args=(600,)).start()
    ctypes.CDLL(None).pthread_exit(None)  # only this thread ends; the process lives on


@pytest.fixture
def started():
    """Start a spawned process running a target; kill and reap them all after."""
    processes: list[multiprocessing.process.BaseProcess] = []

    def start(target):
        processes.append(SPAWN.Process(target=target))
        processes[-1].start()
        return processes[-1]

    yield start
    for process in processes:
        process.kill()
        process.join(10)


def test_a_running_process_has_no_exit_status(started):
    process = started(sleep_forever)
    time.sleep(0.2)
    assert exit_status(process.pid) is None


@pytest.mark.parametrize(
    ("target", "end", "status"),
    [
        (sleep_forever, signal.SIGKILL, -9),
        (sleep_forever, signal.SIGTERM, -15),
        (exit_with_3, None, 3),
    ],
)
def test_an_ended_process_not_yet_reaped_reads_as_multiprocessing_reports_it(
    started, target, end, status
):
    process = started(target)
    if end is not None:
        os.kill(process.pid, end)
    wait_for(lambda: connection.wait([process.sentinel], 0), 10)  # ended; nobody reaped it
    assert exit_status(process.pid) == status
    process.join(5)
    assert process.exitcode == status


def test_a_main_thread_that_exited_shows_before_the_sentinel_does(started):
    process = started(main_thread_exits_while_a_thread_lingers)
    wait_for(lambda: exit_status(process.pid) is not None, 10)
    assert exit_status(process.pid) == 0
    assert not connection.wait([process.sentinel], 0.5)  # its pipes are still open


def test_a_process_that_is_gone_or_never_was_has_none(started):
    process = started(exit_with_3)
    process.join(10)  # reaped: no /proc entry
    assert exit_status(process.pid) is None
    assert exit_status(2**22 + 1) is None  # above Linux's pid_max
