"""bench/engine_counters.py on real processes: an "EngineCore"-labelled child that spins."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

from bench.engine_counters import EngineCounters, read_engine_counters

SPIN = """import sys, time
end = time.process_time() + float(sys.argv[1])
while time.process_time() < end:
    pass
time.sleep(30)
"""


def test_an_engine_childs_cpu_steps_and_switches_are_read_and_subtracted(tmp_path):
    (tmp_path / "steps-1").write_bytes(struct.pack("<Q", 7))
    before = read_engine_counters(os.getpid(), tmp_path)
    child = subprocess.Popen([sys.executable, "-c", SPIN, "0.3", "EngineCore_DP0"])
    try:
        deadline = time.monotonic() + 30
        while (now := read_engine_counters(os.getpid(), tmp_path)).cpu_s < 0.3:
            assert time.monotonic() < deadline, now
            time.sleep(0.05)
        (tmp_path / "steps-2").write_bytes(struct.pack("<Q", 5))
        run = read_engine_counters(os.getpid(), tmp_path).since(before)
    finally:
        child.kill()
        child.wait()
    assert isinstance(run, EngineCounters)
    assert run.cpu_s >= 0.3  # the child's, not this process's
    assert run.steps == 5  # what appeared since `before`
    assert run.wait_s >= 0 and run.preemptions >= 0
    assert run.machine_switches > 0  # this loop's sleeps alone switch


def test_a_process_not_labelled_as_an_engine_is_not_counted(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", SPIN, "0.2", "api_server"])
    try:
        time.sleep(1.0)
        counters = read_engine_counters(os.getpid(), tmp_path)
    finally:
        child.kill()
        child.wait()
    assert counters.cpu_s == 0 and counters.steps == 0 and counters.preemptions == 0
