"""Which threads wake per engine step: every thread's voluntary and involuntary context
switches per engine step, in the gateway, a client process and the engine core, over a
window of a zero-compute run (issue 38: what the hop adds on a box with few cores).

    python -m bench.probes.thread_switches [--model DIR] [--concurrency 256] [--window-s 3]

The gateway (`engine-gateway serve` with bench.zero_engine's executor) is driven by
``python -m bench.probes.client_cost`` in its own process, so each process's threads are its own.
A voluntary switch is a thread going to sleep (it will be woken: a wake-up); an involuntary
one is the kernel taking its core while it could still run. Threads of one name in one
process (vLLM's gloo threads, for one) are summed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from client import AsyncClient

from ..engine_counters import context_switches, engine_pids, read_steps
from ..targets import ROOT, EngineSetup, GatewayServer

__all__ = ["thread_switches", "main"]

Counts = dict[tuple[str, int], tuple[int, int]]  # (thread name, tid) -> (voluntary, involuntary)


def thread_switches(pid: int) -> Counts:
    """Every thread of ``pid``: its name and context switches so far."""
    counts: Counts = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            name, voluntary, involuntary = context_switches(task)
            counts[(name, int(task.name))] = (voluntary, involuntary)
    return counts


def _per_step(before: Counts, after: Counts, steps: int) -> dict[str, list[float]]:
    """Thread name -> [threads, voluntary per step, involuntary per step]."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for key, (voluntary, involuntary) in after.items():
        if key in before:
            row = rows[key[0]]
            row[0] += 1
            row[1] += (voluntary - before[key][0]) / steps
            row[2] += (involuntary - before[key][1]) / steps
    return rows


async def _wait_ready(address: str, server: GatewayServer) -> None:
    try:
        async with AsyncClient(address, name="thread-switches", connect_timeout_s=300):
            pass
    except Exception as exc:
        raise RuntimeError(f"gateway did not start:\n{server.process.tail()}") from exc


def run(args: argparse.Namespace) -> str:
    """Start the gateway, drive it, count; the table as markdown."""
    from gateway.tiny_model import ensure_tiny_model

    model = args.model or str(ensure_tiny_model())
    server = GatewayServer(model, setup=EngineSetup(executor="zero"))
    try:
        asyncio.run(_wait_ready(server.ipc, server))
        client = subprocess.Popen(
            [sys.executable, "-m", "bench.probes.client_cost", "--address", server.ipc,
             "--concurrency", str(args.concurrency), "--requests", str(args.requests),
             "--output-len", str(args.output_len), "--runs", "1"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(args.warmup_s)
        processes = {"gateway": server.process.pid, "client": client.pid}
        processes |= {f"engine {pid}": pid for pid in engine_pids(server.process.pid)}
        before = {name: thread_switches(pid) for name, pid in processes.items()}
        steps0, start = read_steps(server.process.steps_dir), time.monotonic()
        time.sleep(args.window_s)
        after = {name: thread_switches(pid) for name, pid in processes.items()}
        steps, wall = read_steps(server.process.steps_dir) - steps0, time.monotonic() - start
        summary, _ = client.communicate(timeout=600)
    finally:
        server.stop()
    if client.returncode != 0 or not steps:
        raise RuntimeError(f"the client run failed ({client.returncode}) or no step was counted")
    lines = [
        f"{steps} engine steps in {wall:.1f} s ({steps / wall:.0f}/s) at c={args.concurrency};"
        f" client: {summary.strip().splitlines()[-1] if summary.strip() else '-'}",
        "",
        "| process | thread | threads | voluntary / step | involuntary / step |",
        "|---|---|---|---|---|",
    ]
    for name in processes:
        rows = _per_step(before[name], after[name], steps)
        for thread, (count, voluntary, involuntary) in sorted(rows.items()):
            if voluntary + involuntary >= 0.01:
                lines.append(
                    f"| {name} | {thread} | {count} | {voluntary:.2f} | {involuntary:.2f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.thread_switches", description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded tiny model")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--requests", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--window-s", type=float, default=3.0)
    print(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
