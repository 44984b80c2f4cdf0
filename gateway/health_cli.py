"""``engine-gateway health ADDR``: a readiness check for scripts and orchestrators.

    engine-gateway health tcp://127.0.0.1:5557
    engine-gateway health tcp://gw:5557 --server-key keys/server/server.key \\
        --client-key keys/clients/probe.key_secret

Sends one GetHealth (no session needed) and prints the gateway's state. Exit status: 0 when
it is serving; 1 when it answers but is not (draining, engine dead), or answers with what
is not a gateway's health reply (another service on that port); 3 when no answer came
within ``--timeout`` (with CURVE: often keys the gateway does not allow, since it answers
nothing to those); 2 for a bad command line. Needs only pyzmq and msgspec.
"""

from __future__ import annotations

import argparse
import os
import sys

import zmq

from client.keys import load_client_keys
from codec import GetHealth, HealthReply, decode_server, encode

__all__ = ["health_main"]

EXIT_NOT_SERVING = 1
EXIT_USAGE = 2
EXIT_NO_ANSWER = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-gateway health",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("address", help="the gateway's tcp:// or ipc:// address")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)"
    )
    parser.add_argument("--server-key", metavar="FILE", help="the gateway's public CURVE key")
    parser.add_argument("--client-key", metavar="FILE", help="this client's CURVE key_secret")
    return parser


def health_main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.server_key) != bool(args.client_key):
        parser.error("--server-key and --client-key go together (a CURVE gateway needs both)")
    if not 0 < args.timeout <= 86_400:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if not args.address.startswith(("tcp://", "ipc://")):
        parser.error(
            f"address {args.address!r}: give it as tcp://HOST:PORT or ipc://PATH"
            " (e.g. tcp://127.0.0.1:5557)"
        )
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, b"health-" + os.urandom(8).hex().encode())
    try:
        if args.server_key:
            try:
                server, public, secret = load_client_keys(args.server_key, args.client_key)
            except (OSError, ValueError) as exc:
                parser.error(f"CURVE keys: {exc}")
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                server,
                public,
                secret,
            )
        try:
            sock.connect(args.address)
        except zmq.ZMQError as exc:
            parser.error(f"address {args.address!r}: {exc}")
        sock.send_multipart(encode(GetHealth(1)))
        if not sock.poll(int(args.timeout * 1000)):
            hint = (
                " (with CURVE, a key the gateway does not allow gets no answer at all)"
                if args.server_key
                else " (a CURVE gateway answers nothing without keys: --server-key, --client-key)"
            )
            print(f"{args.address}: no answer within {args.timeout:g}s{hint}", file=sys.stderr)
            return EXIT_NO_ANSWER
        frames = sock.recv_multipart()
    finally:
        sock.close(0)
    try:
        reply = decode_server(frames)
    except Exception as exc:  # noqa: BLE001 - whatever a peer that is no gateway sends
        print(
            f"{args.address}: the answer is not a gateway's ({type(exc).__name__}: {exc});"
            " is another service on that address?",
            file=sys.stderr,
        )
        return EXIT_NOT_SERVING
    if not isinstance(reply, HealthReply):
        print(f"{args.address}: unexpected answer {type(reply).__name__}", file=sys.stderr)
        return EXIT_NOT_SERVING
    loads = ", ".join(f"rank {e.engine_index}: {e.running} running" for e in reply.engines)
    print(
        f"{args.address}: {reply.state}, {reply.live_requests} live requests,"
        f" {reply.connected_clients} clients{', paused' if reply.paused else ''}"
        + (f" ({loads})" if loads else "")
    )
    return 0 if reply.ready else EXIT_NOT_SERVING
