"""bench/engine_counters.py on real processes: an "EngineCore"-labelled child that spins.

The child runs under a parent of its own, whose counters are read: the test process may
already have engines of its own (a session's shared engine, whichever tests ran before)."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil

from bench.engine_counters import EngineCounters, read_engine_counters
from tests.helpers import kill_all

SPIN = """import sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
time.sleep(30)
"""
# A parent that only waits for its one child (SPIN with its arguments).
PARENT = "import subprocess, sys; subprocess.run([sys.executable, '-c', *sys.argv[1:]])"


@contextlib.contextmanager
def spinning_child(cpu_s: str, label: str) -> Iterator[int]:
    """The pid of a parent whose only child spins for ``cpu_s`` with ``label`` in its
    command line; both killed at the end."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, SPIN, cpu_s, label])
    try:
        yield parent.pid
    finally:
        kill_all([child.pid for child in psutil.Process(parent.pid).children(recursive=True)])
        parent.kill()
        parent.wait()


def test_an_engine_childs_cpu_steps_and_switches_are_read_and_subtracted(tmp_path):
    (tmp_path / "steps-1").write_bytes(struct.pack("<Q", 7))
    with spinning_child("0.3", "EngineCore_DP0") as pid:
        before = read_engine_counters(pid, tmp_path)  # the child may not have started yet
        deadline = time.monotonic() + 30
        while (now := read_engine_counters(pid, tmp_path)).cpu_s < 0.3:
            assert time.monotonic() < deadline, now
            time.sleep(0.05)
        (tmp_path / "steps-2").write_bytes(struct.pack("<Q", 5))
        run = read_engine_counters(pid, tmp_path).since(before)
    assert isinstance(run, EngineCounters)
    assert run.cpu_s >= 0.3  # the child's, not this process's
    assert run.steps == 5  # what appeared since `before`
    assert run.wait_s >= 0 and run.preemptions >= 0
    assert run.machine_switches > 0  # this loop's sleeps alone switch


def test_a_process_not_labelled_as_an_engine_is_not_counted(tmp_path):
    with spinning_child("0.2", "api_server") as pid:
        time.sleep(1.0)
        counters = read_engine_counters(pid, tmp_path)
    assert counters.cpu_s == 0 and counters.steps == 0 and counters.preemptions == 0
