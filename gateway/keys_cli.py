"""``engine-gateway keys``: CURVE key files for the gateway and its clients.

    engine-gateway keys --server keys/server
    engine-gateway keys --client alice keys/clients --allow-dir keys/allowed
    engine-gateway serve --curve-secret-key keys/server/server.key_secret \\
        --curve-allow-dir keys/allowed

Folders are created as needed; an existing key is never replaced without --force.
Needs only pyzmq (works with the client-only install).
"""

from __future__ import annotations

import argparse
import sys

from client.keys import create_keys

__all__ = ["keys_main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-gateway keys",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--server",
        metavar="DIR",
        help="make DIR/server.key and DIR/server.key_secret (for --curve-secret-key)",
    )
    which.add_argument(
        "--client",
        nargs=2,
        metavar=("NAME", "DIR"),
        help="make DIR/NAME.key and DIR/NAME.key_secret (for load_client_keys)",
    )
    parser.add_argument(
        "--allow-dir",
        metavar="DIR",
        help="with --client: also copy NAME.key into DIR (the gateway's --curve-allow-dir)",
    )
    parser.add_argument("--force", action="store_true", help="replace existing key files")
    return parser


def keys_main(argv: list[str]) -> int:
    """Make the key files asked for; exit status 2 with one line on failure."""
    args = build_parser().parse_args(argv)
    if args.server is not None:
        if args.allow_dir is not None:
            print("engine-gateway keys: error: --allow-dir goes with --client", file=sys.stderr)
            return 2
        name, folder = "server", args.server
    else:
        name, folder = args.client
    try:
        public, secret = create_keys(folder, name, allow_dir=args.allow_dir, force=args.force)
    except (OSError, ValueError) as exc:
        print(f"engine-gateway keys: error: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    if args.allow_dir is not None:
        print(f"allowed:    {args.allow_dir}/{public.name}")
    return 0
