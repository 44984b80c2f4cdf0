"""Profile the gateway on vLLM's real EngineCore with no model compute (zero-compute
executor): where its CPU per output token goes.

    python -m bench.gateway_profile --concurrency 256 --output-len 512 --out bench/results/x

The gateway and its vLLM engine client run in this process under pyinstrument; the
load comes from `engine-gateway bench` in a subprocess (32-token prompts by default).
Writes OUT.txt (the profile) and OUT.json (throughput and this process's CPU per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from .targets import ROOT, ZERO_EXECUTOR


async def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from gateway.server import Gateway
    from gateway.sessions import GatewayLimits
    from gateway.tiny_model import ensure_tiny_model
    from gateway.vllm_engine import VllmEngine, default_engine_args

    engine_args = default_engine_args(
        str(ensure_tiny_model()),
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=2048,
        distributed_executor_backend=ZERO_EXECUTOR,
    )
    engine = await VllmEngine.start(engine_args)
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/profile.sock"
    limits = GatewayLimits(max_in_flight_per_client=100_000, max_in_flight_total=100_000)
    gateway = Gateway(engine, address, limits)
    serving = asyncio.ensure_future(gateway.serve())
    await gateway.ready.wait()

    def load(concurrency: int, count: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gateway",
            "bench",
            "--address",
            address,
            "--concurrency",
            str(concurrency),
            "--num-prompts",
            str(count),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--no-progress",
        ]

    me = psutil.Process()
    try:
        # Warm-up, not profiled.
        await asyncio.to_thread(subprocess.run, load(64, 64), cwd=ROOT, capture_output=True)
        profiler = None
        if not args.no_profile:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005, async_mode="disabled")
            profiler.start()
        cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
        tokens0 = gateway.table.stats.output_tokens
        measured = load(args.concurrency, args.num_prompts)
        done = await asyncio.to_thread(
            subprocess.run, measured, cwd=ROOT, capture_output=True, text=True
        )
        wall = time.monotonic() - t0
        cpu = sum(me.cpu_times()[:2]) - cpu0
        tokens = gateway.table.stats.output_tokens - tokens0
        if profiler is not None:
            profiler.stop()
            args.out.with_suffix(".txt").write_text(
                profiler.output_text(unicode=False, color=False, show_all=False)
            )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
    finally:
        gateway.stop()
        await asyncio.gather(serving, return_exceptions=True)
        await engine.aclose()
    return {
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "profiled": not args.no_profile,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "gateway_process_cpu_us_per_token": cpu / tokens * 1e6,
        "gateway_process_cores": cpu / wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_profile", description=__doc__)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--no-profile", action="store_true", help="measure only (no profiler cost)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway_profile")
    args = p.parse_args(argv)
    import uvloop

    result = uvloop.run(run(args))  # the loop `engine-gateway serve` runs on
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
