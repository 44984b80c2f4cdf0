"""Control-call latency under load: the gateway's control messages beside vLLM's HTTP dev-mode
routes (VLLM_SERVER_DEV_MODE=1) doing the same thing, on the same model and engine flags.

    python -m bench.probes.control_latency [--calls 30] [--load 16]

For each frontend in turn: ``--load`` streams run greedy 64-in/256-out requests in a closed
loop, while one controller makes ``--calls`` rounds of pause(keep), resume, reset the prefix
cache, and read stats (GetStats; vLLM: GET /metrics). Reports p50/p99 milliseconds from
sending the call to its reply, per operation, as JSON and Markdown in bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from client import AsyncClient, SamplingParams

from ..stats import percentile
from ..targets import GatewayServer, HttpTarget
from ..workload import Workload

RESULTS = Path(__file__).resolve().parents[1] / "results"
OPERATIONS = ("pause", "resume", "reset_prefix_cache", "stats")


async def _load(stream: Callable[[list[int], int], Awaitable], streams: int, stop) -> int:
    """Closed-loop background load until ``stop`` is set; returns requests finished."""
    requests = Workload(prompt_len=(64, 64), output_len=(256, 256)).requests(10_000)
    done = 0

    async def worker(offset: int) -> None:
        nonlocal done
        i = offset
        while not stop.is_set():
            prompt, max_tokens = requests[i % len(requests)]
            await stream(prompt, max_tokens)
            done += 1
            i += streams

    await asyncio.gather(*(worker(k) for k in range(streams)))
    return done


async def _measure(calls: dict[str, Callable[[], Awaitable]], rounds: int) -> dict:
    timings: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            await call()
            timings[name].append((time.perf_counter() - start) * 1e3)
        await asyncio.sleep(0.05)
    return {
        name: {"p50_ms": percentile(v, 0.5), "p99_ms": percentile(v, 0.99), "n": len(v)}
        for name, v in timings.items()
    }


async def gateway_side(model: str, rounds: int, streams: int) -> dict:
    server = GatewayServer(model, extra_flags=("--control-open", "--engine-stats"))
    try:
        async with (
            AsyncClient(server.ipc, name="load", connect_timeout_s=300) as load,
            AsyncClient(server.ipc, name="trainer", connect_timeout_s=300) as ctl,
        ):

            async def stream(prompt: list[int], max_tokens: int) -> None:
                sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                async for _ in load.generate(prompt, sampling):
                    pass

            stop = asyncio.Event()
            running = asyncio.ensure_future(_load(stream, streams, stop))
            await asyncio.sleep(2)
            result = await _measure(
                {
                    "pause": lambda: ctl.pause("keep"),
                    "resume": ctl.resume,
                    "reset_prefix_cache": ctl.reset_prefix_cache,
                    "stats": ctl.stats,
                },
                rounds,
            )
            stop.set()
            result["load_requests_finished"] = await running
            return result
    finally:
        server.stop()


async def http_side(model: str, rounds: int, streams: int) -> dict:
    target = HttpTarget(model, dev_mode=True)
    try:
        await target.start()
        session = target._session

        def post(path: str) -> Callable[[], Awaitable]:
            async def call() -> None:
                async with session.post(target.base + path) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{path}: HTTP {resp.status}")

            return call

        async def metrics() -> None:
            async with session.get(target.base + "/metrics") as resp:
                await resp.read()

        async def stream(prompt: list[int], max_tokens: int) -> None:
            await target.stream(prompt, max_tokens)

        stop = asyncio.Event()
        running = asyncio.ensure_future(_load(stream, streams, stop))
        await asyncio.sleep(2)
        result = await _measure(
            {
                "pause": post("/pause?mode=keep&clear_cache=false"),
                "resume": post("/resume"),
                "reset_prefix_cache": post("/reset_prefix_cache"),
                "stats": metrics,
            },
            rounds,
        )
        stop.set()
        result["load_requests_finished"] = await running
        return result
    finally:
        await target.stop()


def markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "# Control-call latency under load (ms, from sending the call to its reply)",
        "",
        f"`python -m bench.probes.control_latency --calls {args.calls} --load {args.load}`: "
        f"{args.load} greedy 64-in/256-out streams run while one controller makes "
        f"{args.calls} rounds of each call. vLLM: `vllm serve --tokens-only` with "
        "VLLM_SERVER_DEV_MODE=1 (`/pause?mode=keep`, `/resume`, `/reset_prefix_cache`, "
        "stats = `GET /metrics`).",
        "",
        "| operation | gateway p50 | gateway p99 | vLLM HTTP p50 | vLLM HTTP p99 | p50 ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    gw, http = results["gateway"], results["vllm-http"]
    for op in OPERATIONS:
        ratio = http[op]["p50_ms"] / gw[op]["p50_ms"] if gw[op]["p50_ms"] else float("nan")
        lines.append(
            f"| {op} | {gw[op]['p50_ms']:.2f} | {gw[op]['p99_ms']:.2f} | "
            f"{http[op]['p50_ms']:.2f} | {http[op]['p99_ms']:.2f} | {ratio:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.control_latency", description=__doc__)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--load", type=int, default=16)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from gateway.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model())
    results = {
        "gateway": asyncio.run(gateway_side(model, args.calls, args.load)),
        "vllm-http": asyncio.run(http_side(model, args.calls, args.load)),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "control_latency.json").write_text(json.dumps(results, indent=1))
    text = markdown(results, args)
    (args.out / "control_latency.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
