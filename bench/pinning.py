"""``--pin-engine-cores N``: the engine processes on the last N cores, everything else
(the benchmark's own process, frontends, load generators) on the rest.

On a box with fewer cores than busy threads, a frontend's threads take turns on the engine
core's CPU (bench/results/burst_switches.md); pinned apart, no frontend can delay an engine
step, and what remains between targets is the frontends' own work. Every thread of every
process under the benchmark is pinned (Linux affinity is per thread; threads started later
inherit their creator's).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import psutil

from .engine_counters import is_engine_process

__all__ = ["pin_engines_apart", "split_cpus"]


def split_cpus(engine_cores: int) -> tuple[set[int], set[int]]:
    """(the engines' cpus, everyone else's) from this process's allowed cpus."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 0 < engine_cores < len(cpus):
        raise SystemExit(
            f"--pin-engine-cores {engine_cores}: this process may run on {len(cpus)} cpus;"
            " the engines need at least one and the rest at least one"
        )
    return set(cpus[-engine_cores:]), set(cpus[:-engine_cores])


def _pin_threads(pid: int, cpus: set[int]) -> int:
    pinned = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
    return pinned


def pin_engines_apart(engine_cpus: set[int], other_cpus: set[int]) -> dict[str, int]:
    """Pin this process and every process under it; threads pinned, by side."""
    counts = {"engine": 0, "other": _pin_threads(os.getpid(), other_cpus)}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            side = "engine" if is_engine_process(child) else "other"
            counts[side] += _pin_threads(child.pid, engine_cpus if side == "engine" else other_cpus)
    return counts
