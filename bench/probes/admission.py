"""Where a burst of requests waits on its way from the client to the engine's first step.

    python -m bench.probes.admission --burst 256,1024 --rounds 3 --out bench/results/admission
    python -m bench.probes.admission --burst 1024 --arms gateway --yield-every 1,32,100000

Both arms drive vLLM's real EngineCore with the zero-compute executor (bench/zero_engine.py)
started with vLLM's per-request events (``log_stats``), so the engine's own QUEUED (its
scheduler took the request) and SCHEDULED (first step that ran it) timestamps are read
beside the frontends'. Every timestamp is ``time.monotonic()`` (CLOCK_MONOTONIC: one clock
for every process of the machine on Linux), in ms after the burst's first send.

- ``gateway``: the gateway in this process, its methods wrapped with timers (as
  bench.probes.gateway_profile does); the burst comes from a client process (``client.AsyncClient``)
  that starts N streams at once and records when each was sent and its first token came.
- ``direct``: vLLM's engine client in this process, N tasks at once, each validating and
  submitting as the benchmark's ``direct`` target does (``VllmEngine.prepare`` and
  ``add_requests``, the same code the gateway runs).

Stages, per request: ``sent`` (client) -> ``decoded`` (gateway read and decoded the frame)
-> ``validated`` (vLLM's InputProcessor done) -> ``submitted`` (vLLM's engine client sent
it) -> ``queued`` (engine) -> ``scheduled`` (engine) -> ``first_output`` (gateway / direct
client) -> ``client_first`` (client). Each request's outputs run to ``--output-len`` (512:
the burst benchmark's shape), so later waves wait for earlier ones as they do there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..targets import ROOT, ZERO_EXECUTOR
from ..workload import Workload

STAGES = ("sent", "decoded", "validated", "submitted", "queued", "scheduled", "first_output")
CLIENT_PREFIX = "ADMISSION_CLIENT "
_QUEUED, _SCHEDULED = 1, 2  # vLLM's EngineCoreEventType values


async def _start_engine() -> Any:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from gateway.tiny_model import ensure_tiny_model
    from gateway.vllm import VllmEngine, default_engine_args

    args = default_engine_args(
        str(ensure_tiny_model()),
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=2048,
        distributed_executor_backend=ZERO_EXECUTOR,
    )
    return await VllmEngine.start(args, engine_stats=True)


def _note_engine_events(record: dict[str, float], out: Any, now: float) -> None:
    record.setdefault("first_output", now)
    for event in out.events or ():
        kind = {_QUEUED: "queued", _SCHEDULED: "scheduled"}.get(int(event.type))
        if kind is not None:
            record.setdefault(kind, event.timestamp)


# ------------------------------------------------------------------ gateway arm


def _instrument_gateway(gateway: Any, records: dict[str, dict[str, float]]) -> None:
    """Wrap the table's on_message, the engine's add_requests and the gateway's on_step."""
    from codec import Generate

    table, engine = gateway.table, gateway.engine
    on_message, add_requests, on_step = table.on_message, engine.add_requests, gateway._on_step

    def timed_on_message(client_id, msg, now, user_id=None):  # noqa: ANN001, ANN202
        decoded = time.monotonic()
        effects = on_message(client_id, msg, now, user_id)
        if type(msg) is Generate:
            validated = time.monotonic()
            for core in effects.submit:
                records[core.request_id] = {
                    "client_request_id": msg.request_id,
                    "decoded": decoded,
                    "validated": validated,
                }
        return effects

    async def timed_add_requests(prepared):  # noqa: ANN001, ANN202
        await add_requests(prepared)
        submitted = time.monotonic()
        for core in prepared:
            if core.request_id in records:
                records[core.request_id]["submitted"] = submitted

    def timed_on_step(outputs):  # noqa: ANN001, ANN202
        now = time.monotonic()
        for out in outputs:
            record = records.get(out.request_id)
            if record is not None:
                _note_engine_events(record, out, now)
        on_step(outputs)

    table.on_message = timed_on_message
    engine.add_requests = timed_add_requests
    gateway._on_step = timed_on_step  # before serve(): its output loop binds it there


async def gateway_arm(
    engine: Any, bursts: list[int], output_len: int, rounds: int, yield_every: int
) -> list[dict]:
    import gateway.server as server
    from gateway.sessions import GatewayLimits

    server._YIELD_EVERY = yield_every
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-adm-')}/gw.sock"
    limits = GatewayLimits(max_in_flight_per_client=100_000, max_in_flight_total=100_000)
    gateway = server.Gateway(engine, address, limits)
    records: dict[str, dict[str, float]] = {}
    _instrument_gateway(gateway, records)
    serving = asyncio.ensure_future(gateway.serve())
    await gateway.ready.wait()
    runs = []
    try:
        await _client_burst(address, 64, output_len, 0)  # warm-up
        for round_index in range(rounds):
            for burst in bursts:
                records.clear()
                client = await _client_burst(address, burst, output_len, round_index + 1)
                by_client_id = {r.pop("client_request_id"): r for r in records.values()}
                rows = []
                for request_id, (sent, first) in client.items():
                    row = dict(by_client_id.get(request_id, {}))
                    row["sent"], row["client_first"] = sent, first
                    rows.append(row)
                runs.append(_summary("gateway", burst, yield_every, rows))
    finally:
        gateway.stop()
        await asyncio.gather(serving, return_exceptions=True)
    return runs


async def _client_burst(address: str, burst: int, output_len: int, salt: int) -> dict:
    cmd = [sys.executable, "-m", "bench.probes.admission", "--client", address]
    cmd += ["--burst", str(burst), "--output-len", str(output_len), "--salt", str(salt)]
    done = await asyncio.to_thread(
        subprocess.run, cmd, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    for line in done.stdout.splitlines():
        if line.startswith(CLIENT_PREFIX):
            return json.loads(line[len(CLIENT_PREFIX) :])
    raise RuntimeError(f"the burst client failed:\n{done.stderr[-3000:]}")


async def client_main(address: str, burst: int, output_len: int, salt: int) -> None:
    """The load: ``burst`` streams started at once; prints {request_id: [sent, first]}."""
    from client import AsyncClient, SamplingParams

    prompts = Workload((32, 32), (output_len, output_len)).requests(burst, salt=salt)
    sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    times: dict[str, list[float]] = {}

    async def one(index: int, prompt: list[int]) -> None:
        request_id = f"b{salt}-{index}"
        sent = time.monotonic()
        first = None
        async for out in client.generate(prompt, sampling, request_id=request_id):
            if first is None and out.new_token_ids:
                first = time.monotonic()
        times[request_id] = [sent, first]

    async with AsyncClient(address) as client:
        await asyncio.gather(*(one(i, p) for i, (p, _) in enumerate(prompts)))
    print(CLIENT_PREFIX + json.dumps(times), flush=True)


# ------------------------------------------------------------------ direct arm


async def direct_arm(engine: Any, bursts: list[int], output_len: int, rounds: int) -> list[dict]:
    from codec import Generate, SamplingParams

    records: dict[str, dict[str, float]] = {}
    finished: dict[str, asyncio.Event] = {}

    async def read() -> None:
        while True:
            outputs = await engine.get_output()
            now = time.monotonic()
            for out in outputs:
                record = records.get(out.request_id)
                if record is not None:
                    _note_engine_events(record, out, now)
                if out.finish_reason is not None and out.request_id in finished:
                    finished[out.request_id].set()

    async def one(request_id: str, prompt: list[int]) -> None:
        record = records[request_id] = {"sent": time.monotonic()}
        sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        prepared = engine.prepare(request_id, Generate(request_id, prompt, True, sampling))
        record["validated"] = time.monotonic()
        await engine.add_requests(prepared)
        record["submitted"] = time.monotonic()
        await finished[request_id].wait()

    async def burst_of(burst: int, salt: int) -> list[dict]:
        records.clear()
        finished.clear()
        prompts = Workload((32, 32), (output_len, output_len)).requests(burst, salt=salt)
        ids = [f"d{salt}-{i}" for i in range(burst)]
        finished.update((rid, asyncio.Event()) for rid in ids)
        await asyncio.gather(*(one(rid, p) for rid, (p, _) in zip(ids, prompts, strict=True)))
        return list(records.values())

    reader = asyncio.ensure_future(read())
    runs = []
    try:
        await burst_of(64, 0)  # warm-up
        for round_index in range(rounds):
            for burst in bursts:
                rows = await burst_of(burst, round_index + 1)
                runs.append(_summary("direct", burst, None, rows))
    finally:
        reader.cancel()
    return runs


# ------------------------------------------------------------------ summary


def _summary(arm: str, burst: int, yield_every: int | None, rows: list[dict]) -> dict:
    """Per stage: ms after the burst's first send at which the first 128 requests (the
    first batch the CPU engine schedules: max_num_seqs 128) and all of them got there."""
    start = min(row["sent"] for row in rows)
    stages = [*STAGES, "client_first"]
    ordered = sorted(rows, key=lambda row: row["sent"])
    first_batch = ordered[:128]

    def stage_ms(selection: list[dict], stage: str, pick: Callable[[list[float]], float]) -> Any:
        values = [row[stage] - start for row in selection if row.get(stage) is not None]
        return round(pick(values) * 1e3, 2) if values else None

    def per_request_ms(stage_from: str, stage_to: str) -> Any:
        gaps = [
            row[stage_to] - row[stage_from]
            for row in rows
            if row.get(stage_from) is not None and row.get(stage_to) is not None
        ]
        return round(statistics.median(gaps) * 1e3, 3) if gaps else None

    return {
        "arm": arm,
        "burst": burst,
        "yield_every": yield_every,
        "first_batch_last_ms": {s: stage_ms(first_batch, s, max) for s in stages},
        "all_p50_ms": {s: stage_ms(rows, s, statistics.median) for s in stages},
        "all_last_ms": {s: stage_ms(rows, s, max) for s in stages},
        "median_gap_ms": {
            f"{a}->{b}": per_request_ms(a, b) for a, b in zip(stages, stages[1:], strict=False)
        },
        # CPU the loop spent in vLLM's InputProcessor for the whole burst.
        "validation_total_ms": round(
            sum(r["validated"] - r.get("decoded", r["sent"]) for r in rows) * 1e3, 2
        ),
    }


def _markdown(runs: list[dict]) -> str:
    keys = ("arm", "burst", "yield_every")
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(tuple(run[k] for k in keys), []).append(run)
    lines = [
        "Medians over rounds; ms after the burst's first send. `first 128`: the last of the",
        "first 128 requests sent (the CPU engine's first batch) to reach the stage.",
        "",
        "| arm | burst | yield every | stage | first 128: last | all: p50 | all: last |",
        "|---|---|---|---|---|---|---|",
    ]

    def med(group: list[dict], table: str, stage: str) -> Any:
        values = [run[table][stage] for run in group if run[table][stage] is not None]
        return round(statistics.median(values), 1) if values else "-"

    for (arm, burst, every), group in groups.items():
        for stage in (*STAGES, "client_first"):
            if med(group, "all_p50_ms", stage) == "-":
                continue
            lines.append(
                f"| {arm} | {burst} | {every or '-'} | {stage} | "
                f"{med(group, 'first_batch_last_ms', stage)} | {med(group, 'all_p50_ms', stage)}"
                f" | {med(group, 'all_last_ms', stage)} |"
            )
    lines += ["", "Median per-request gaps between stages (ms):", ""]
    lines += ["| arm | burst | yield every | gap | ms |", "|---|---|---|---|---|"]
    for (arm, burst, every), group in groups.items():
        for gap in group[0]["median_gap_ms"]:
            values = [run["median_gap_ms"][gap] for run in group]
            if None in values:
                continue
            lines.append(
                f"| {arm} | {burst} | {every or '-'} | {gap} | "
                f"{round(statistics.median(values), 3)} |"
            )
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace) -> list[dict]:
    bursts = [int(b) for b in args.burst.split(",")]
    engine = await _start_engine()
    runs: list[dict] = []
    try:
        for arm in args.arms.split(","):
            if arm == "direct":
                runs += await direct_arm(engine, bursts, args.output_len, args.rounds)
            else:
                for every in (int(e) for e in args.yield_every.split(",")):
                    runs += await gateway_arm(engine, bursts, args.output_len, args.rounds, every)
    finally:
        await engine.aclose()
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst", default="256,1024", help="comma list of burst sizes")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default="direct,gateway")
    p.add_argument("--yield-every", default="32", help="gateway arm: _YIELD_EVERY values")
    p.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.md")
    p.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("--salt", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        asyncio.run(client_main(args.client, int(args.burst), args.output_len, args.salt))
        return 0
    import uvloop

    runs = uvloop.run(run(args))
    report = _markdown(runs)
    print(report)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
        args.out.with_suffix(".md").write_text(
            "# Where a burst waits (`python -m bench.probes.admission`)\n\n" + report
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
