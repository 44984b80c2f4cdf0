"""``engine-gateway http``: vLLM's HTTP routes for RL frameworks, over one or more gateways.

    engine-gateway http --gateway tcp://127.0.0.1:5557 --port 8000 --api-key "$TOKEN"

A framework that talks to ``vllm serve`` points its base URL at ``http://HOST:PORT``
(docs/FRAMEWORKS.md). Control routes (pause, weights, LoRA) need ``--api-key`` and a
gateway that allows this face's key (``--client-key``'s public half in the gateway's
``--control-key``, or ``--control-open``). Needs the ``http`` extra (aiohttp).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

__all__ = ["http_main"]


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The module's docstring as written, and each flag's default where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS, []):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-gateway http",
        description=__doc__,
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--gateway",
        action="append",
        required=True,
        metavar="ADDR",
        help="a gateway's address (repeat for a pool: requests go to the least loaded)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    parser.add_argument(
        "--api-key",
        help="the operator's bearer token (default: $VLLM_API_KEY); control routes need it",
    )
    parser.add_argument(
        "--open-data-routes",
        action="store_true",
        help="generate, completions and models without the token (control routes keep it)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the model's tokenizer folder: text prompts, text and stop strings on"
        " /v1/completions (client.text; the text extra)",
    )
    parser.add_argument("--served-model-name", help="the model's name in requests and /v1/models")
    parser.add_argument("--server-key", metavar="FILE", help="the gateways' public CURVE key")
    parser.add_argument("--client-key", metavar="FILE", help="this face's CURVE key_secret")
    parser.add_argument(
        "--connect-timeout", type=float, default=60.0, help="seconds to wait for a gateway"
    )
    limits = parser.add_argument_group("per-request and per-caller bounds")
    limits.add_argument(
        "--max-prompts-per-request", type=int, default=1024, metavar="N",
        help="prompts in one /v1/completions body",
    )  # fmt: skip
    limits.add_argument(
        "--max-samples-per-request", type=int, default=4096, metavar="N",
        help="samples (prompts x n) in one request",
    )  # fmt: skip
    limits.add_argument(
        "--max-in-flight-per-caller", type=int, default=0, metavar="N",
        help="requests one caller (a bearer token, or an address) has at the gateways at once;"
        " more wait their turn (0: half the gateways' --max-in-flight-per-client, summed)",
    )  # fmt: skip
    limits.add_argument(
        "--max-queued-per-caller", type=int, default=4096, metavar="N",
        help="requests of one caller waiting for their turn; more are refused with 429",
    )  # fmt: skip
    limits.add_argument(
        "--request-read-timeout", type=float, default=60.0, metavar="S",
        help="seconds a request's head and body may take to arrive (and an idle"
        " keep-alive connection stays open)",
    )  # fmt: skip
    return parser


async def _serve(args: argparse.Namespace, curve_keys: tuple[bytes, bytes, bytes] | None) -> int:
    from client.pool import GatewayPool

    from .app import HttpFace, serving
    from .limits import FaceLimits

    logger = logging.getLogger("engine_gateway.http")
    tokenizer = None
    if args.tokenizer:
        from client.text import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    logger.info(
        "waiting up to %gs (--connect-timeout) for a session with %s",
        args.connect_timeout,
        ", ".join(args.gateway),
    )
    async with GatewayPool(
        args.gateway,
        name="http-face",
        curve_keys=curve_keys,
        connect_timeout_s=args.connect_timeout,
    ) as pool:
        up = next(c for c in pool.clients if c.connected)
        info = await up.model_info()
        face = HttpFace(
            pool,
            info.model,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            open_data_routes=args.open_data_routes,
            tokenizer=tokenizer,
            limits=FaceLimits(
                max_prompts=args.max_prompts_per_request,
                max_samples=args.max_samples_per_request,
                max_in_flight_per_caller=args.max_in_flight_per_caller,
                max_queued_per_caller=args.max_queued_per_caller,
                read_timeout_s=args.request_read_timeout,
            ),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with serving(face, args.host, args.port) as port:
            logger.info(
                "serving vLLM's routes for %s on http://%s:%d over %s (control routes: %s)",
                face.model_name,
                args.host,
                port,
                ", ".join(args.gateway),
                "need the bearer token" if args.api_key else "refused: no --api-key",
            )
            await stop.wait()
    return 0


def http_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is None:  # read here: the help never shows the token
        args.api_key = os.environ.get("VLLM_API_KEY")
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        parser.error("needs aiohttp: pip install 'engine-gateway[http]'")
    for address in args.gateway:
        if not address.startswith(("tcp://", "ipc://")):
            parser.error(f"--gateway {address!r}: give it as tcp://HOST:PORT or ipc://PATH")
    for name in ("max_prompts_per_request", "max_samples_per_request"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_in_flight_per_caller < 0 or args.max_queued_per_caller < 0:
        parser.error("--max-in-flight-per-caller and --max-queued-per-caller must not be negative")
    if not args.request_read_timeout > 0:
        parser.error("--request-read-timeout must be positive")
    if bool(args.server_key) != bool(args.client_key):
        parser.error("--server-key and --client-key go together (a CURVE gateway needs both)")
    curve_keys = None
    if args.server_key:
        from client.keys import load_client_keys

        try:
            curve_keys = load_client_keys(args.server_key, args.client_key)
        except (OSError, ValueError) as exc:
            parser.error(f"CURVE keys: {exc}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from client.errors import GatewayUnavailable

    try:
        return asyncio.run(_serve(args, curve_keys))
    except GatewayUnavailable as exc:
        print(f"engine-gateway http: {exc}", file=sys.stderr)
        return 3
