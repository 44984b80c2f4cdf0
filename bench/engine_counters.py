"""What a benchmark reads from a target's engine processes: their CPU time, and the
steps the zero-compute executor counts (bench/zero_engine.py)."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import psutil

__all__ = ["STEPS_DIR_ENV", "ENGINE_PROCESS_TAGS", "engine_cpu_seconds", "read_steps"]

# When set, each zero-compute engine counts its steps in DIR/steps-<pid> (8 bytes, mmap).
STEPS_DIR_ENV = "ENGINE_GATEWAY_ZERO_STEPS_DIR"
# Process names or command lines of vLLM's engine side (the rest of a server is frontend).
ENGINE_PROCESS_TAGS = ("EngineCore", "Worker", "Coordinator")


def _is_engine(process: psutil.Process) -> bool:
    label = " ".join([process.name(), *process.cmdline()])
    return any(tag in label for tag in ENGINE_PROCESS_TAGS)


def engine_cpu_seconds(pid: int) -> float:
    """CPU seconds of the engine-core, worker and DP-coordinator processes under ``pid``."""
    total = 0.0
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if _is_engine(child):
                    t = child.cpu_times()
                    total += t.user + t.system
    return total


def read_steps(folder: str | Path) -> int:
    """Engine steps so far, summed over the engines counting in ``folder``."""
    total = 0
    for path in Path(folder).glob("steps-*"):
        data = path.read_bytes()
        if len(data) == 8:
            total += struct.unpack("<Q", data)[0]
    return total
