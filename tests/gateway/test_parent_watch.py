"""parent_watch.watch_parent on real processes: a child started by a process that is then
SIGKILLed gets the signal at once (and SIGKILL after the grace period if it ignores it);
while its parent lives, nothing happens."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gateway.parent_watch import watch_parent
from tests.helpers import gone, kill_all, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")
SPAWN = multiprocessing.get_context("spawn")
POLL_S = 0.2


def watched_child(record: str, signum: int, grace_s: float, ignore: bool) -> None:
    """Watch the parent; write down the signal that ends this process, or ignore it."""

    def on_signal(received: int, _frame: object) -> None:
        Path(record).write_text(signal.Signals(received).name)
        os._exit(0)

    signal.signal(signum, signal.SIG_IGN if ignore else on_signal)
    watch_parent(signum, poll_s=POLL_S, grace_s=grace_s)
    time.sleep(600)


def parent_of_a_watched_child(record: str, signum: int, grace_s: float, ignore: bool) -> None:
    child = SPAWN.Process(target=watched_child, args=(record, signum, grace_s, ignore))
    child.start()
    Path(record + ".pid").write_text(str(child.pid))
    time.sleep(600)


@pytest.fixture
def family(tmp_path):
    """Start a parent whose child watches it; both killed after the test."""
    pids: list[int] = []

    def start(signum: int = signal.SIGTERM, grace_s: float = 30.0, ignore: bool = False):
        record = str(tmp_path / "signal")
        parent = SPAWN.Process(
            target=parent_of_a_watched_child, args=(record, signum, grace_s, ignore)
        )
        parent.start()
        wait_for(lambda: Path(record + ".pid").exists(), 30)
        time.sleep(0.1)  # the pid is written before the file is closed
        child = int(Path(record + ".pid").read_text())
        pids.extend([parent.pid, child])
        time.sleep(1.0)  # the child is up and watching
        return parent, child, Path(record)

    yield start
    kill_all(pids)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_killed_parent_s_child_gets_the_signal_at_once(family, signum):
    parent, child, record = family(signum)
    time.sleep(3 * POLL_S)
    assert not gone(child) and not record.exists()  # the parent lives: nothing happens
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(10)
    took = wait_for(lambda: gone(child), 10)
    assert record.read_text() == signal.Signals(signum).name
    assert took < 2 * POLL_S + 1.0  # the sentinel tells at once; the pid poll within POLL_S


def test_a_child_that_ignores_the_signal_is_killed_after_the_grace_period(family):
    parent, child, record = family(grace_s=1.0, ignore=True)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join(10)
    time.sleep(0.5)
    assert not gone(child)  # signalled, ignored, still in its grace period
    took = wait_for(lambda: gone(child), 10)
    assert took < 2.0 and not record.exists()


def test_a_process_multiprocessing_did_not_start_is_not_watched():
    assert multiprocessing.parent_process() is None
    assert watch_parent() is None
