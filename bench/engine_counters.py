"""What a benchmark reads from a target's engine processes: their CPU time, the time
their threads sat runnable without a CPU (the kernel's schedstat), how often the kernel
took the core from them, the steps the zero-compute executor counts
(bench/zero_engine.py), and the machine's context switches over the same run."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path
from typing import NamedTuple

import psutil

__all__ = [
    "STEPS_DIR_ENV",
    "ENGINE_PROCESS_TAGS",
    "EngineCounters",
    "context_switches",
    "engine_pids",
    "frontend_cpu_seconds",
    "is_engine_process",
    "read_engine_counters",
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


def is_engine_process(process: psutil.Process) -> bool:
    """An engine-core, worker or DP-coordinator process (by name or command line)."""
    return _is_engine(_label(process))


def engine_pids(pid: int) -> list[int]:
    """The engine-core, worker and DP-coordinator processes under ``pid`` (a process's
    main thread has its pid for thread id)."""
    pids = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if is_engine_process(child):
                    pids.append(child.pid)
    return pids


def _wait_ns(tid: int) -> int:
    """Nanoseconds thread ``tid`` sat runnable without a core (``schedstat``'s second
    field). On a box with fewer cores than busy threads, this is time other threads took."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path(f"/proc/{tid}/task/{tid}/schedstat").read_text().split()[1])
    return 0


def context_switches(task: Path) -> tuple[str, int, int]:
    """(name, voluntary, involuntary context switches) of a thread: ``task`` is its
    ``/proc/PID/task/TID`` folder. Raises OSError once the thread is gone."""
    fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines())
    return (
        fields["Name"].strip(),
        int(fields["voluntary_ctxt_switches"]),
        int(fields["nonvoluntary_ctxt_switches"]),
    )


def _preemptions(tid: int) -> int:
    with contextlib.suppress(OSError, ValueError, KeyError):
        return context_switches(Path(f"/proc/{tid}/task/{tid}"))[2]
    return 0


def machine_context_switches() -> int:
    """Context switches on the whole machine since boot (``/proc/stat``'s ``ctxt``): each
    wake-up of any thread (a frontend's loop, a ZeroMQ I/O thread) is at least one."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("ctxt "):
                return int(line.split()[1])
    return 0


class EngineCounters(NamedTuple):
    """Cumulative counters of a target's engine side; ``since`` gives a run's share."""

    cpu_s: float  # engine-core, worker and DP-coordinator processes
    steps: int  # zero-compute executor only, else 0
    wait_s: float  # the engine main threads' time runnable without a core
    preemptions: int  # times the kernel took the core from an engine main thread
    machine_switches: int  # context switches on the whole machine

    def since(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(*(now - then for now, then in zip(self, before, strict=True)))


def read_engine_counters(pid: int, steps_dir: str | Path) -> EngineCounters:
    """The counters of the engine processes under ``pid`` (steps from ``steps_dir``); wait
    and preemptions are their main threads' (the engine core's busy loop, which schedules
    each step)."""
    pids = engine_pids(pid)
    cpu_s = 0.0
    for engine in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            cpu_s += _cpu(psutil.Process(engine))
    return EngineCounters(
        cpu_s=cpu_s,
        steps=read_steps(steps_dir),
        wait_s=sum(_wait_ns(tid) for tid in pids) / 1e9,
        preemptions=sum(_preemptions(tid) for tid in pids),
        machine_switches=machine_context_switches(),
    )


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
