"""Running one gateway process: the engine (or a group's share of it), the server on its
listener, signals, metrics, until drained or the engine died.

``cli.serve_main`` calls ``run_gateway`` for ``serve``; ``group.gateway_process_main``
calls it in each gateway of ``serve --gateway-count N``. It imports the server and, once
running, vLLM (through ``gateway.vllm``); it does not import the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import signal
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .parent_watch import parent_gone
from .preflight import UsageError
from .routing import RoutingConfig
from .sessions import GatewayLimits
from .stop_signals import stoppable_start
from .weight_buffers import WeightBufferFolder

__all__ = ["engines_dead_reason", "gateway_version", "limits_from_args", "run_gateway"]

logger = logging.getLogger("engine_gateway")
EXIT_START_FAILED = 1


def engines_dead_reason() -> str:
    """Why a group's gateway was told (SIGUSR1) that its engines are dead: what its clients'
    ENGINE_DEAD errors say."""
    supervisor = multiprocessing.parent_process()  # it spawned this process: its pid is ppid
    if supervisor is not None and parent_gone(supervisor, supervisor.pid):
        return f"the gateways' supervisor (pid {supervisor.pid}) was killed; its engines stop"
    return "the gateways' supervisor saw an engine process exit (its log names it)"


def gateway_version() -> str:
    try:
        return version("engine-gateway")
    except PackageNotFoundError:
        return "0+unknown"


def _curve_config(args: argparse.Namespace):  # noqa: ANN202 - CurveConfig | None
    if args.curve_secret_key is None:
        return None
    from .auth import CurveConfig

    return CurveConfig(args.curve_secret_key, args.curve_allow_dir)


def _control_policy(args: argparse.Namespace):  # noqa: ANN202 - ControlPolicy
    from .auth import ControlPolicy

    if args.control_open:
        return ControlPolicy(open=True)
    return ControlPolicy.from_key_files(args.control_key)


def limits_from_args(
    args: argparse.Namespace, max_model_len: int, multimodal: bool = False
) -> GatewayLimits:
    """The gateway's limits from its flags, defaults that follow the model filled in."""
    limits = GatewayLimits(
        max_frame_bytes=args.max_frame_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_in_flight_per_client=args.max_in_flight_per_client,
        max_in_flight_total=args.max_in_flight_total,
        max_abort_ids=args.max_abort_ids,
        max_queued_requests=args.max_queued_requests,
        max_request_rate_per_client=args.max_request_rate_per_client,
        request_rate_burst=args.request_rate_burst,
        client_send_hwm=args.client_send_hwm,
        max_clients=args.max_clients,
        default_heartbeat_interval_s=args.heartbeat_interval,
        max_multimodal_items=args.max_multimodal_items,
        max_multimodal_item_bytes=int(args.max_multimodal_item_mb * 2**20),
        max_multimodal_request_bytes=int(args.max_multimodal_request_mb * 2**20),
        multimodal_cache_bytes=int(args.multimodal_cache_mb * 2**20),
        max_multimodal_bytes_in_flight=int(args.max_multimodal_in_flight_mb * 2**20),
        max_multimodal_bytes_in_flight_per_client=int(
            args.max_multimodal_in_flight_per_client_mb * 2**20
        ),
    )
    return limits.for_model(max_model_len, multimodal)


def serving_line(gateway: Any, engine: Any, args: argparse.Namespace, control: Any) -> str:
    """The one line that says the gateway serves, and how: where, with which model and
    limits, CURVE, who may call control operations, routing, metrics."""
    info = engine.info
    wl = gateway.table.wire_limits
    if control.open:
        who = "open to every client"
    elif control.allowed_keys:
        who = f"{len(control.allowed_keys)} CURVE key(s)"
    else:
        who = "nobody"
    routing = engine.routing_stats() if hasattr(engine, "routing_stats") else None
    route = "vLLM's balancer" if routing is None else routing["policy"]
    if routing is not None and routing.get("index"):
        route += f", PrefixQuery index {routing['index']}"
    metrics = "off" if args.metrics_port is None else f"port {args.metrics_port}"
    return (
        f"engine-gateway {gateway_version()} serving {info.model_name} on"
        f" {' '.join(gateway.addresses)} (CURVE {'on' if gateway.curve_on else 'off'};"
        f" control calls: {who}; routing: {route}; metrics: {metrics};"
        f" max_model_len={info.max_model_len}, vocab={info.vocab_size},"
        f" eos={list(info.eos_token_ids)}, cpu_attention={info.cpu_attention or '-'},"
        f" max_in_flight={wl.max_in_flight_per_client}/client {wl.max_in_flight_total} total,"
        f" max_frame_bytes={wl.max_frame_bytes})"
    )


async def run_gateway(
    args: argparse.Namespace,
    engine_args: object,
    vllm_config: object,
    client_config: dict | None = None,
    ready_event: Any = None,
) -> int:
    """Serve until drained or the engine died. ``client_config``: this process is one of
    several gateways on an engine group its supervisor started (gateway/group.py)."""
    from .server import BindError, Gateway, Listener, freeze_startup_heap
    from .vllm import LoraModuleRefused, VllmEngine

    model_config = vllm_config.model_config
    limits = limits_from_args(args, model_config.max_model_len, model_config.is_multimodal_model)
    # Bind first: a bad or busy address fails in a second, not after engine start-up.
    try:
        listener = Listener(args.bind, limits, curve=_curve_config(args))
    except BindError as exc:
        raise UsageError("--bind", str(exc)) from None
    try:
        registry = None
        if args.metrics_port is not None:
            from .metrics import start_metrics_server

            try:
                registry = start_metrics_server(None, args.metrics_port, args.metrics_host)
            except OSError as exc:
                raise UsageError(
                    "--metrics-port", f"{args.metrics_host}:{args.metrics_port}: {exc.strerror}"
                ) from None
        try:
            logger.info(
                "starting the engine for %s: vLLM loads the weights, profiles memory and"
                " sizes the KV cache (about 30 s for the tiny model on a CPU, minutes for a"
                " large one); vLLM's own lines follow",
                model_config.model,
            )
            async with stoppable_start():  # SIGTERM (and SIGINT) stop it: StopRequested
                engine = await VllmEngine.start(
                    engine_args,
                    dict(args.lora_module),
                    vllm_config=vllm_config,
                    engine_stats=args.engine_stats,
                    client_config=client_config,
                    routing=RoutingConfig.from_args(args),
                )
            engine.weight_buffers = WeightBufferFolder(
                args.weight_buffer_dir, args.weight_arena_mb << 20
            )
            cache = vllm_config.cache_config
            logger.info(
                "engine up: %d data-parallel rank(s), %s KV-cache blocks of %s tokens",
                vllm_config.parallel_config.data_parallel_size,
                cache.num_gpu_blocks,
                cache.block_size,
            )
        except LoraModuleRefused as exc:  # the engine stopped again: a bad command line
            raise UsageError("--lora-module", str(exc)) from None
        except Exception as exc:
            logger.exception("the engine failed to start")
            print(f"engine-gateway serve: the engine failed to start: {exc}", file=sys.stderr)
            return EXIT_START_FAILED
    except BaseException:
        listener.close(linger=0)
        raise
    control = _control_policy(args)
    if vllm_config.kv_transfer_config is not None and control.allows_nobody:
        logger.warning(
            "the engine has a KV connector, but no client may send kv_transfer_params: allow"
            " the prefill/decode coordinator with --control-key (or --control-open)"
        )
    try:
        gateway = Gateway(
            engine,
            listener.addresses,
            limits,
            drain_timeout_s=args.drain_timeout,
            engine_dead_grace_s=args.engine_dead_grace,
            gateway_version=gateway_version(),
            listener=listener,
            control=control,
            weight_update_timeout_s=args.weight_update_timeout,
            cache_isolation=args.cache_isolation,
            # Gateways of one group share the engines: their request ids must not collide.
            engine_id_prefix="g" if client_config is None else f"g{client_config['client_index']}.",
        )
        if registry is not None:
            from .metrics import GatewayCollector

            registry.register(GatewayCollector(gateway))
        freeze_startup_heap()
        loop = asyncio.get_running_loop()
        interrupts = 0

        def on_signal(signum: int) -> None:
            nonlocal interrupts
            interrupts += 1
            if signum == signal.SIGINT and interrupts > 1:
                gateway.stop()
            else:
                gateway.drain()

        # A group's gateways take no SIGINT: their supervisor drains them (stop_signals.py).
        signals = (
            (signal.SIGTERM,) if client_config is not None else (signal.SIGTERM, signal.SIGINT)
        )
        for signum in signals:
            loop.add_signal_handler(signum, on_signal, signum)
        if client_config is not None:  # the supervisor saw the engine group die
            loop.add_signal_handler(signal.SIGUSR1, lambda: engine.mark_dead(engines_dead_reason()))
        serving = asyncio.ensure_future(gateway.serve())
        await asyncio.wait(
            [serving, asyncio.ensure_future(gateway.ready.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        if gateway.ready.is_set():
            logger.info("%s", serving_line(gateway, engine, args, control))
            if ready_event is not None:
                ready_event.set()
        return await serving
    finally:
        await engine.aclose()
