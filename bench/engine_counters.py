"""What a benchmark reads from a target's engine processes: their CPU time, the time
their threads sat runnable without a CPU (the kernel's schedstat), and the steps the
zero-compute executor counts (bench/zero_engine.py)."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import psutil

__all__ = [
    "STEPS_DIR_ENV",
    "ENGINE_PROCESS_TAGS",
    "engine_cpu_seconds",
    "engine_wait_seconds",
    "frontend_cpu_seconds",
    "read_steps",
]

# When set, each zero-compute engine counts its steps in DIR/steps-<pid> (8 bytes, mmap).
STEPS_DIR_ENV = "ENGINE_GATEWAY_ZERO_STEPS_DIR"
# Process names or command lines of vLLM's engine side (the rest of a server is frontend).
ENGINE_PROCESS_TAGS = ("EngineCore", "Worker", "Coordinator")


def _label(process: psutil.Process) -> str:
    return " ".join([process.name(), *process.cmdline()])


def _cpu(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system


def _tree_cpu_seconds(pid: int, wanted) -> float:  # noqa: ANN001 - (label) -> bool
    """CPU seconds of the processes under ``pid`` whose name/command line ``wanted`` takes."""
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if wanted(_label(child)):
                    total += _cpu(child)
    return total


def _is_engine(label: str) -> bool:
    return any(tag in label for tag in ENGINE_PROCESS_TAGS)


def engine_cpu_seconds(pid: int) -> float:
    """CPU seconds of the engine-core, worker and DP-coordinator processes under ``pid``."""
    return _tree_cpu_seconds(pid, _is_engine)


def engine_wait_seconds(pid: int) -> float:
    """Seconds the main threads of the engine processes under ``pid`` (the engine core's
    busy loop, which schedules each step) spent runnable but not running: waiting for a
    core (``/proc/PID/task/PID/schedstat``'s second field). On a box with fewer cores
    than busy threads, this is engine time other threads took."""
    total_ns = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, OSError, ValueError, IndexError):
                if _is_engine(_label(child)):
                    schedstat = Path(f"/proc/{child.pid}/task/{child.pid}/schedstat")
                    total_ns += int(schedstat.read_text().split()[1])
    return total_ns / 1e9


def frontend_cpu_seconds(pid: int) -> float:
    """CPU seconds of a server process and its frontend children (API servers, gateways):
    everything but its engine processes and multiprocessing's resource tracker."""

    def frontend(label: str) -> bool:
        return not _is_engine(label) and "resource_tracker" not in label

    with contextlib.suppress(psutil.NoSuchProcess):
        return _cpu(psutil.Process(pid)) + _tree_cpu_seconds(pid, frontend)
    return 0.0


def read_steps(folder: str | Path) -> int:
    """Engine steps so far, summed over the engines counting in ``folder``."""
    total = 0
    for path in Path(folder).glob("steps-*"):
        data = path.read_bytes()
        if len(data) == 8:
            total += struct.unpack("<Q", data)[0]
    return total
