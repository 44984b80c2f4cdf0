"""Profile the gateway on vLLM's real EngineCore with no model compute (zero-compute
executor): where its CPU per output token goes.

    python -m bench.probes.gateway_profile --concurrency 256 --output-len 512 --out bench/results/x

The gateway and its vLLM engine client run in this process under pyinstrument; the
load comes from `engine-gateway bench` in a subprocess (32-token prompts by default).
Writes OUT.txt (the profile) and OUT.json (throughput and this process's CPU per token).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from ..targets import ROOT, ZERO_EXECUTOR


async def run(args: argparse.Namespace) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from gateway.server import Gateway, freeze_startup_heap
    from gateway.sessions import GatewayLimits
    from gateway.tiny_model import ensure_tiny_model
    from gateway.vllm import VllmEngine, default_engine_args

    engine_args = default_engine_args(
        str(ensure_tiny_model()),
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=2048,
        **({"distributed_executor_backend": ZERO_EXECUTOR} if args.executor == "zero" else {}),
    )
    engine = await VllmEngine.start(engine_args)
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/profile.sock"
    limits = GatewayLimits(max_in_flight_per_client=100_000, max_in_flight_total=100_000)
    # Before serve(): its loops bind some of the timed methods once, at start.
    components: dict[str, float] = {}
    restore = time_components(components) if args.components else (lambda: None)
    gateway = Gateway(engine, address, limits)
    if not args.no_freeze:
        freeze_startup_heap()  # as `engine-gateway serve` does
    gc_counts: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    gc.callbacks.append(gc_timer(gc_counts))
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
        if args.no_profile:
            pass
        elif args.profiler == "py-spy":
            # On-CPU samples only: a wall-clock sampler also counts the time this process
            # sat descheduled (2 cores shared with the engine and the load).
            collapsed = args.out.with_suffix(".collapsed")
            profiler = subprocess.Popen(
                [
                    *(Path(sys.executable).parent / "py-spy", "record"),
                    *("--pid", str(os.getpid()), "--rate", "1000", "--nonblocking"),
                    *("--format", "raw", "--output", str(collapsed)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            await asyncio.sleep(1.0)  # attached
        elif args.profiler == "cprofile":
            # Every call of this thread timed with its CPU clock: exact call counts and
            # CPU by function, each inflated by the clock reads (a syscall per event).
            import cProfile

            profiler = cProfile.Profile(time.thread_time)
            profiler.enable()
        else:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005, async_mode="disabled")
            profiler.start()
        components.clear()  # the warm-up's
        for counts in gc_counts.values():
            counts[:] = [0, 0.0]
        threads0, sleeps0, sched0 = thread_cpu_seconds(), thread_sleeps(), thread_schedstat()
        cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
        tokens0 = gateway.table.stats.output_tokens
        steps0, step_s0 = gateway.step_histogram.count, gateway.step_histogram.total
        measured = load(args.concurrency, args.num_prompts)
        done = await asyncio.to_thread(
            subprocess.run, measured, cwd=ROOT, capture_output=True, text=True
        )
        wall = time.monotonic() - t0
        cpu = sum(me.cpu_times()[:2]) - cpu0
        threads1, sleeps1, sched1 = thread_cpu_seconds(), thread_sleeps(), thread_schedstat()
        tokens = gateway.table.stats.output_tokens - tokens0
        steps = gateway.step_histogram.count - steps0
        step_s = gateway.step_histogram.total - step_s0
        if isinstance(profiler, subprocess.Popen):
            profiler.send_signal(signal.SIGINT)
            await asyncio.to_thread(profiler.wait, 60)
            args.out.with_suffix(".txt").write_text(summarize_collapsed(collapsed))
        elif args.profiler == "cprofile" and profiler is not None:
            profiler.disable()
            args.out.with_suffix(".txt").write_text(summarize_cprofile(profiler, steps))
        elif profiler is not None:
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
        restore()
    return {
        "executor": args.executor,
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
        "engine_steps": steps,
        "outputs_per_step": tokens / steps,
        "gateway_process_cpu_us_per_step": cpu / steps * 1e6,
        # Wall time in the output loop per step: table, encode, sends (not the receive).
        "step_handling_us": step_s / steps * 1e6,
        "heap_frozen": not args.no_freeze,
        # Garbage collections during the measured run: generation -> [count, seconds].
        "gc_collections": {str(g): [n, round(t, 4)] for g, (n, t) in gc_counts.items()},
        # CPU time of the event loop's thread in these calls, per output token.
        "cpu_us_per_token_in": {
            name: round(seconds / tokens * 1e6, 2) for name, seconds in components.items()
        },
        # Sleeps (voluntary context switches), each a wake-up, per engine step.
        "sleeps_per_step_by_thread": {
            name: round((sleeps1.get(name, 0) - sleeps0.get(name, 0)) / steps, 2)
            for name in sorted(sleeps1)
        },
        "cpu_us_per_token_by_thread": {
            name: round((threads1.get(name, 0.0) - threads0.get(name, 0.0)) / tokens * 1e6, 2)
            for name in sorted(threads1)
        },
        # The scheduler's own clock (exact, where the columns above are sampled at the
        # tick): per engine step, µs each thread ran and µs it sat runnable but not running
        # (preempted, or woken and waiting for a core: on-CPU samplers count that time too).
        "sched_us_per_step_by_thread": {
            name: {
                kind: round((sched1[name][i] - sched0.get(name, (0, 0))[i]) / steps * 1e6, 1)
                for i, kind in enumerate(("running", "runnable"))
            }
            for name in sorted(sched1)
        },
    }


def gc_timer(collections: dict[int, list[float]]) -> Callable[[str, dict], None]:
    """A gc.callbacks hook adding each collection's count and seconds to ``collections``."""
    started = [0.0]

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts = collections[info["generation"]]
            counts[0] += 1
            counts[1] += time.perf_counter() - started[0]

    return hook


def time_components(totals: dict[str, float]) -> Callable[[], None]:
    """Add the thread CPU time spent in the gateway's main per-step and per-request calls
    to ``totals`` (one clock read per call, not per token); returns the undo."""
    from vllm.v1.serial_utils import MsgpackDecoder

    from gateway.server import Gateway
    from gateway.sessions import SessionTable
    from gateway.vllm import VllmEngine

    timed = {
        "table.on_step (per step)": (SessionTable, "on_step"),
        "encode + zmq send to the client (per step)": (Gateway, "_send"),
        "vLLM EngineCoreOutputs decode (per step)": (MsgpackDecoder, "decode"),
        "table.on_message (per request, incl. prepare)": (SessionTable, "on_message"),
        "vLLM InputProcessor (prepare, per request)": (VllmEngine, "prepare"),
    }
    originals = []
    for name, (owner, attribute) in timed.items():
        original = getattr(owner, attribute)
        originals.append((owner, attribute, original))

        def timed_call(*args, _original=original, _name=name, **kwargs):  # noqa: ANN002, ANN003
            start = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + time.thread_time() - start

        setattr(owner, attribute, timed_call)

    def restore() -> None:
        for owner, attribute, original in originals:
            setattr(owner, attribute, original)

    return restore


def summarize_collapsed(path: Path, top: int = 35) -> str:
    """py-spy's collapsed stacks as two tables: share of on-CPU samples spent in each
    function itself, and in each function including what it called."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"py-spy on-CPU samples: {total} (all threads)", "", "self %  function"]
    lines += [f"{100 * n / total:6.2f}  {frame}" for frame, n in own.most_common(top)]
    lines += ["", "total %  function (with callees)"]
    lines += [f"{100 * n / total:6.2f}  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines) + "\n"


def summarize_cprofile(profiler: object, steps: int, top: int = 40) -> str:
    """A cProfile run on the thread CPU clock as calls and µs per engine step, by own
    time and by time with callees."""
    import pstats

    stats = pstats.Stats(profiler)
    lines = [f"cProfile, thread CPU clock; per engine step ({steps} steps)"]
    for key, title in (("tottime", "own"), ("cumulative", "with callees")):
        stats.sort_stats(key)
        lines += ["", f"calls/step  own µs/step  cum µs/step  function (by {title})"]
        for func in stats.fcn_list[:top]:
            _, calls, own, cum, _ = stats.stats[func]
            where = f"{Path(func[0]).name}:{func[1]}({func[2]})"
            lines.append(
                f"{calls / steps:10.2f}  {own / steps * 1e6:10.1f}  {cum / steps * 1e6:11.1f}"
                f"  {where}"
            )
    return "\n".join(lines) + "\n"


def thread_cpu_seconds() -> dict[str, float]:
    """This process's CPU seconds by thread kind: the event loop's thread ("main"), zmq's
    I/O threads ("ZMQbg/IO"), and the rest by their names (torch, vLLM helpers); and for
    each, "NAME (system)": the part spent in the kernel (syscalls, wake-ups)."""
    totals: dict[str, float] = {}
    main_tid = threading.get_native_id()
    for thread in psutil.Process().threads():
        try:
            name = _thread_kind(Path(f"/proc/self/task/{thread.id}"), main_tid)
        except OSError:
            continue
        totals[name] = totals.get(name, 0.0) + thread.user_time + thread.system_time
        totals[name + " (system)"] = totals.get(name + " (system)", 0.0) + thread.system_time
    return totals


def _thread_kind(task: Path, main_tid: int) -> str:
    """A thread's kind from its ``/proc/self/task/TID`` folder: "main" for the event
    loop's thread, else its name without the trailing number ("ZMQbg/IO/0" -> "ZMQbg/IO")."""
    if int(task.name) == main_tid:
        return "main"
    name = (task / "comm").read_text().strip()
    return name.rstrip("0123456789").rstrip("/") or "other"


def thread_schedstat() -> dict[str, tuple[float, float]]:
    """Seconds each kind of thread of this process ran and sat runnable without running,
    from the scheduler's own accounting (``/proc/self/task/*/schedstat``)."""
    totals: dict[str, tuple[float, float]] = {}
    main_tid = threading.get_native_id()
    for task in Path("/proc/self/task").iterdir():
        try:
            running, waiting = (task / "schedstat").read_text().split()[:2]
            name = _thread_kind(task, main_tid)
        except OSError:  # the thread ended meanwhile
            continue
        ran, waited = totals.get(name, (0.0, 0.0))
        totals[name] = (ran + int(running) / 1e9, waited + int(waiting) / 1e9)
    return totals


def thread_sleeps() -> dict[str, int]:
    """Voluntary context switches of this process's threads, summed by thread name.

    Each is one sleep (a blocking wait) and so one wake-up to come: on a VM a wake-up
    of a sleeping thread is among the dearest things a frontend does.
    """
    totals: dict[str, int] = {}
    main_tid = threading.get_native_id()
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
            name = _thread_kind(task, main_tid)
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                totals[name] = totals.get(name, 0) + int(line.split()[1])
    return totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.gateway_profile", description=__doc__)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--no-profile", action="store_true", help="measure only (no profiler cost)")
    p.add_argument(
        "--executor",
        choices=("zero", "real"),
        default="zero",
        help="zero: vLLM's EngineCore with no forward pass (the frontend's ceiling);"
        " real: the tiny model's forward pass on the CPU",
    )
    p.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the start-up heap to the garbage collector (serve freezes it)",
    )
    p.add_argument(
        "--components",
        action="store_true",
        help="also time the main calls with the thread CPU clock (a syscall per read on a"
        " VM: adds ~0.5 µs per token; leave off for profiles)",
    )
    p.add_argument(
        "--profiler",
        choices=["pyinstrument", "py-spy", "cprofile"],
        default="pyinstrument",
        help="pyinstrument: a wall-clock call tree; py-spy: samples of running and runnable"
        " threads (it counts time waiting for a core as CPU); cprofile: every call of the"
        " event loop's thread on its CPU clock, per engine step (inflated by the clock reads)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gateway_profile")
    args = p.parse_args(argv)
    import uvloop

    result = uvloop.run(run(args))  # the loop `engine-gateway serve` runs on
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
