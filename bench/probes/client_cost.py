"""The client library's own CPU per token: an ``AsyncClient`` iterating many streams at once.

    python -m bench.probes.client_cost --address ipc:///tmp/gw.sock --concurrency 256 \\
        --requests 1024 --output-len 512 [--gateway-pid PID] [--runs 3]

Each request is one ``async for`` over ``client.generate`` (greedy, ``ignore_eos``, 32-token
prompts of one id from the model's vocabulary), ``concurrency`` of them at a time, the way a
coordinator consumes streams; nothing else runs in this process, so its CPU is the client's.
With ``--gateway-pid`` the gateway process's CPU over the same runs is shown beside it.
Against ``engine-gateway serve`` with
``--distributed-executor-backend bench.zero_engine.ZeroComputeExecutor`` this is the
client's side of the frontend ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from dataclasses import dataclass

from client import AsyncClient, SamplingParams

__all__ = ["ClientCost", "measure_client_cost", "main"]


@dataclass
class ClientCost:
    tokens: int
    wall_s: float
    client_cpu_s: float
    gateway_cpu_s: float | None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def summary(self, concurrency: int) -> str:
        line = (
            f"c={concurrency}: {self.tokens} tokens, {self.tok_s:.0f} tok/s; client "
            f"{self.client_cpu_s * 1e6 / self.tokens:.2f} µs CPU/token "
            f"({self.client_cpu_s / self.wall_s:.2f} cores)"
        )
        if self.gateway_cpu_s is not None:
            line += f"; gateway {self.gateway_cpu_s * 1e6 / self.tokens:.2f} µs CPU/token"
        return line


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _process_cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def measure_client_cost(
    client: AsyncClient,
    concurrency: int,
    requests: int,
    output_len: int,
    prompt_len: int = 32,
    gateway_pid: int | None = None,
) -> ClientCost:
    """Run ``requests`` streams, ``concurrency`` at a time; CPU of this process and the
    gateway's over the run."""
    sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pending = list(range(requests))
    vocab_size = client.hello_ack.model.vocab_size if client.hello_ack else 256
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while pending:
            i = pending.pop()
            async for out in client.generate([i % vocab_size] * prompt_len, sampling):
                tokens += len(out.new_token_ids)

    gateway0, cpu0, start = _process_cpu_s(gateway_pid), _own_cpu_s(), time.perf_counter()
    async with asyncio.TaskGroup() as tasks:
        for _ in range(min(concurrency, requests)):
            tasks.create_task(worker())
    wall, cpu = time.perf_counter() - start, _own_cpu_s() - cpu0
    gateway1 = _process_cpu_s(gateway_pid)
    gateway = None if gateway0 is None or gateway1 is None else gateway1 - gateway0
    return ClientCost(tokens, wall, cpu, gateway)


async def _run(args: argparse.Namespace) -> list[ClientCost]:
    async with AsyncClient(args.address, name="client-cost", connect_timeout_s=60) as client:
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        await asyncio.gather(*(client.complete([5] * 32, warm) for _ in range(8)))
        results = []
        for _ in range(args.runs):
            cost = await measure_client_cost(
                client,
                args.concurrency,
                args.requests,
                args.output_len,
                args.prompt_len,
                args.gateway_pid,
            )
            print(cost.summary(args.concurrency), flush=True)
            results.append(cost)
        return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.client_cost", description=__doc__)
    p.add_argument("--address", required=True)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--gateway-pid", type=int, default=None)
    args = p.parse_args(argv)
    import uvloop

    uvloop.run(_run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
