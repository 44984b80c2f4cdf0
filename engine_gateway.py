"""``engine-gateway``: the command's entry, dispatching to each package's own CLI.

``serve`` and ``keys`` are the gateway's (``gateway.cli``); ``bench`` is the benchmark's
load generator (``bench.harness``); ``http`` is vLLM's HTTP surface over gateways
(``client.http_face``). Dispatching here keeps the gateway from importing the
benchmark. ``serve`` ends the process when it returns (``gateway.quick_exit``).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from bench.harness import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["http"]:  # the HTTP face is a client: the gateway never imports it
        from client.http_face.cli import http_main

        return http_main(argv[1:])
    from gateway.cli import main as gateway_main

    status = gateway_main(argv)
    if argv[:1] == ["serve"]:  # a process of its own: ended without the teardown
        from gateway.quick_exit import exit_now

        exit_now(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
