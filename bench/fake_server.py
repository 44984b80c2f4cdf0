"""A gateway on the in-process FakeEngine, for the gateway's own ceiling (bench only).

    python -m bench.fake_server --bind ADDR [--step-interval S] [--step-times FILE]
                                [--profile FILE] [--max-model-len N] [--vocab-size V]

On SIGTERM it writes the engine's step times (monotonic seconds, one per line)
and, with --profile, a pyinstrument text profile of the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from gateway.engine import EngineInfo
from gateway.fake_engine import FakeEngine
from gateway.server import Gateway
from gateway.sessions import GatewayLimits


async def serve(args: argparse.Namespace) -> int:
    engine = FakeEngine(
        info=EngineInfo("fake", args.max_model_len, args.vocab_size, (2,), 20, 1 << 16),
        step_interval_s=args.step_interval,
        step_times=[] if args.step_times else None,
    )
    # No slow-consumer cut-off: the fake engine outruns any Python reader, and the
    # ceiling measures the gateway, not the guard (client_send_hwm 0 = unlimited).
    # The frame limit is the default for the model's length (frame_limit_for).
    limits = GatewayLimits(
        max_in_flight_per_client=100_000,
        max_in_flight_total=100_000,
        max_queued_requests=100_000,
        client_send_hwm=0,
    )
    gateway = Gateway(engine, args.bind, limits)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, gateway.stop)
    code = await gateway.serve()
    if args.step_times:
        Path(args.step_times).write_text("\n".join(f"{t:.9f}" for t in engine.step_times))
    return code


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", required=True)
    p.add_argument("--step-interval", type=float, default=0.0)
    p.add_argument("--step-times", default=None)
    p.add_argument("--profile", default=None)
    p.add_argument("--max-model-len", type=int, default=1 << 20)
    p.add_argument("--vocab-size", type=int, default=50_000)
    args = p.parse_args()
    import uvloop

    if args.profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
        try:
            return uvloop.run(serve(args))
        finally:
            profiler.stop()
            Path(args.profile).write_text(
                profiler.output_text(unicode=False, color=False, show_all=False)
            )
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
