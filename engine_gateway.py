"""``engine-gateway``: the command's entry, dispatching to each package's own CLI.

``serve`` and ``keys`` are the gateway's (``gateway.cli``); ``bench`` is the benchmark's
load generator (``bench.harness``). Dispatching here keeps the gateway from importing the
benchmark.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from bench.harness import main as bench_main

        return bench_main(argv[1:])
    from gateway.cli import main as gateway_main

    return gateway_main(argv)


if __name__ == "__main__":
    sys.exit(main())
