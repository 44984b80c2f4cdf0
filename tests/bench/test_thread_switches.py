"""bench/probes/thread_switches.py's counting, on this process's own threads."""

from __future__ import annotations

import os
import threading
import time

from bench.probes.thread_switches import _per_step, thread_switches


def test_a_sleeping_thread_counts_voluntary_switches():
    stop = threading.Event()

    def napper() -> None:
        while not stop.wait(0.005):
            pass

    worker = threading.Thread(target=napper)
    worker.start()
    try:
        time.sleep(0.05)
        before = thread_switches(os.getpid())
        time.sleep(0.3)
        after = thread_switches(os.getpid())
    finally:
        stop.set()
        worker.join()
    [key] = [key for key in after if key[1] == worker.native_id]
    assert after[key][0] - before[key][0] >= 20  # ~60 naps in 0.3 s


def test_per_step_sums_the_threads_of_one_name_and_skips_new_ones():
    before = {("io", 1): (10, 0), ("io", 2): (5, 1), ("loop", 3): (0, 0)}
    after = {("io", 1): (30, 2), ("io", 2): (25, 1), ("loop", 3): (10, 10), ("late", 4): (99, 9)}
    rows = _per_step(before, after, steps=10)
    assert rows == {"io": [2, 4.0, 0.2], "loop": [1, 1.0, 1.0]}
