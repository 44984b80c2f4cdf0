"""``engine-gateway serve``: the gateway on a real vLLM engine, from the command line.

Engine flags are vLLM's own (its parser, via vllm_engine), accepted exactly as
``vllm serve`` accepts them; gateway flags are ours. With no model given it
serves the embedded tiny random Llama, generated and cached on first use.
SIGTERM or Ctrl-C drains (second Ctrl-C stops at once); exit status 0 after
a drain, 3 when the engine died (so a supervisor restarts the gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .sessions import GatewayLimits

__all__ = ["main", "build_parser"]

DEFAULT_BIND = "tcp://127.0.0.1:5557"
logger = logging.getLogger("engine_gateway")


def gateway_version() -> str:
    try:
        return version("engine-gateway")
    except PackageNotFoundError:
        return "0+unknown"


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError("expected NAME=PATH")
    return name, path


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` parser: gateway flags plus every vLLM engine flag."""
    from .vllm_engine import add_engine_cli_args, make_engine_parser

    parser = make_engine_parser(
        prog="engine-gateway serve",
        description="Serve a vLLM engine over one ZeroMQ ROUTER socket (docs/PROTOCOL.md).",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="model to serve (as `vllm serve MODEL`); default: the tiny model",
    )
    g = parser.add_argument_group("gateway")
    g.add_argument(
        "--bind",
        action="append",
        default=None,
        metavar="ADDR",
        help=f"tcp:// or ipc:// address, repeatable (default {DEFAULT_BIND})",
    )
    defaults = GatewayLimits()
    g.add_argument(
        "--max-in-flight-per-client", type=int, default=defaults.max_in_flight_per_client
    )
    g.add_argument("--max-in-flight-total", type=int, default=defaults.max_in_flight_total)
    g.add_argument("--max-frame-bytes", type=int, default=defaults.max_frame_bytes)
    g.add_argument("--max-abort-ids", type=int, default=defaults.max_abort_ids)
    g.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="default: the model's max_model_len"
    )
    g.add_argument(
        "--heartbeat-interval",
        type=float,
        default=defaults.default_heartbeat_interval_s,
        help="seconds, when a client's Hello asks for none",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds live requests may run on after SIGTERM",
    )
    g.add_argument(
        "--engine-dead-grace",
        type=float,
        default=1.0,
        help="seconds to keep answering (health, ENGINE_DEAD refusals) after the engine died,"
        " before exiting with status 3",
    )
    g.add_argument("--max-clients", type=int, default=defaults.max_clients)
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=defaults.max_queued_requests,
        help="samples beyond the engine's max_num_seqs before Overloaded",
    )
    g.add_argument(
        "--max-request-rate-per-client",
        type=float,
        default=defaults.max_request_rate_per_client,
        help="Generates per second per client (token bucket); 0 = unlimited",
    )
    g.add_argument("--request-rate-burst", type=int, default=defaults.request_rate_burst)
    g.add_argument(
        "--client-send-hwm",
        type=int,
        default=defaults.client_send_hwm,
        help="frames queued to one client before it counts as not reading",
    )
    g.add_argument(
        "--curve-secret-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="enable CURVE: the server's secret certificate (zmq.auth format)",
    )
    g.add_argument(
        "--curve-allow-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --curve-secret-key: directory of allowed client public keys",
    )
    g.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port"
    )
    g.add_argument("--metrics-host", default="127.0.0.1")
    g.add_argument(
        "--lora-module",
        action="append",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapter clients may name (with --enable-lora)",
    )
    add_engine_cli_args(parser)
    # Token-only serving needs no tokenizer; --no-skip-tokenizer-init loads one.
    parser.set_defaults(model=None, skip_tokenizer_init=True)
    return parser


def _tiny_model_defaults(args: argparse.Namespace, argv: list[str]) -> None:
    """CPU-friendly engine settings for the embedded model, unless given explicitly."""
    from .tiny_model import ensure_tiny_model

    args.model = str(ensure_tiny_model())
    given = " ".join(argv)
    for flag, attr, value in (
        ("--enforce-eager", "enforce_eager", True),
        ("--gpu-memory-utilization", "gpu_memory_utilization", 0.2),
        ("--max-model-len", "max_model_len", 2048),
    ):
        if flag not in given and flag.replace("-", "_") not in given:
            setattr(args, attr, value)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _curve_config(args: argparse.Namespace):  # noqa: ANN202 - CurveConfig | None
    if args.curve_secret_key is None and args.curve_allow_dir is None:
        return None
    if args.curve_secret_key is None or args.curve_allow_dir is None:
        raise SystemExit("--curve-secret-key and --curve-allow-dir go together")
    from .auth import CurveConfig

    return CurveConfig(args.curve_secret_key, args.curve_allow_dir)


async def _serve(args: argparse.Namespace) -> int:
    from .server import Gateway
    from .vllm_engine import VllmEngine, engine_args_from_namespace

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
    )
    engine = await VllmEngine.start(engine_args_from_namespace(args), dict(args.lora_module))
    try:
        gateway = Gateway(
            engine,
            args.bind or [DEFAULT_BIND],
            limits,
            drain_timeout_s=args.drain_timeout,
            engine_dead_grace_s=args.engine_dead_grace,
            gateway_version=gateway_version(),
            curve=_curve_config(args),
        )
        if args.metrics_port is not None:
            from .metrics import start_metrics_server

            start_metrics_server(gateway, args.metrics_port, args.metrics_host)
        loop = asyncio.get_running_loop()
        interrupts = 0

        def on_signal(signum: int) -> None:
            nonlocal interrupts
            interrupts += 1
            if signum == signal.SIGINT and interrupts > 1:
                gateway.stop()
            else:
                gateway.drain()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        serving = asyncio.ensure_future(gateway.serve())
        await asyncio.wait(
            [serving, asyncio.ensure_future(gateway.ready.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
        if gateway.ready.is_set():
            info = engine.info
            wl = gateway.table.wire_limits
            logger.info(
                "engine-gateway %s serving %s on %s (max_model_len=%d, vocab=%d, eos=%s,"
                " max_in_flight=%d/client %d total, max_frame_bytes=%d)",
                gateway_version(),
                info.model_name,
                " ".join(gateway.addresses),
                info.max_model_len,
                info.vocab_size,
                list(info.eos_token_ids),
                wl.max_in_flight_per_client,
                wl.max_in_flight_total,
                wl.max_frame_bytes,
            )
        return await serving
    finally:
        await engine.aclose()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``engine-gateway`` and ``python -m gateway``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "serve":
        print(
            "usage: engine-gateway serve [MODEL] [--bind ADDR] [gateway and vLLM engine"
            " flags]\n       engine-gateway serve --help",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    argv = argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    if args.model is None:
        _tiny_model_defaults(args, argv)
    try:
        import uvloop

        return uvloop.run(_serve(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
