"""The gateway's own ceiling with the FakeEngine: no engine bounds anything here.

Two measurements on a gateway subprocess (bench.fake_server):
- throughput: one client keeps ``streams`` long requests in flight; the fake
  engine steps as fast as the gateway can go. Reported: frames/s, output
  tokens/s, and tokens/s per gateway core (tokens / gateway CPU seconds).
- added latency per output frame: one request, the fake engine stepping every
  2 ms; for each frame, client receive time minus the engine's step time
  (both CLOCK_MONOTONIC, comparable across processes on Linux): table, encode,
  socket, transport and client decode included.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import psutil

from client import AsyncClient, SamplingParams

from .stats import percentile
from .targets import _Process

RESULTS = Path(__file__).resolve().parent / "results"


async def _throughput(streams: int, seconds: float, profile: Path | None) -> dict:
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/ceiling.sock"
    argv = [sys.executable, "-m", "bench.fake_server", "--bind", address]
    if profile is not None:
        argv += ["--profile", str(profile)]
    server = _Process(argv, "fake-server.log")
    tokens = frames = 0
    try:
        async with AsyncClient(address, name="ceiling", connect_timeout_s=60) as client:
            sampling = SamplingParams(max_tokens=10**9, ignore_eos=True)
            proc = psutil.Process(server.pid)
            stop_at = None

            async def consume(i: int) -> None:
                nonlocal tokens, frames
                async for out in client.generate([i + 10], sampling):
                    tokens += len(out.new_token_ids)
                    frames += 1
                    if stop_at is not None and time.monotonic() >= stop_at:
                        return

            tasks = [asyncio.ensure_future(consume(i)) for i in range(streams)]
            await asyncio.sleep(1.0)  # warm up
            t0, tok0, cpu0 = time.monotonic(), tokens, sum(proc.cpu_times()[:2])
            await asyncio.sleep(seconds)
            wall = time.monotonic() - t0
            got, cpu = tokens - tok0, sum(proc.cpu_times()[:2]) - cpu0
            stop_at = time.monotonic()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        server.stop()
    return {
        "streams": streams,
        "output_tok_s": got / wall,
        "gateway_cpu_utilization": cpu / wall,
        "tok_s_per_gateway_core": got / cpu if cpu else None,
        "engine_steps_s_approx": got / streams / wall,
    }


async def _frame_latency(frames: int, raw: bool = False) -> dict:
    """Engine step -> consumer per frame; ``raw``: a bare protocol client, not AsyncClient."""
    workdir = Path(tempfile.mkdtemp(prefix="eg-"))
    address = f"ipc://{workdir}/latency.sock"
    times_path = workdir / "steps.txt"
    server = _Process(
        [
            sys.executable,
            "-m",
            "bench.fake_server",
            "--bind",
            address,
            "--step-interval",
            "0.002",
            "--step-times",
            str(times_path),
        ],
        "fake-latency.log",
    )
    sampling = SamplingParams(max_tokens=frames, ignore_eos=True)
    try:
        receive = _receive_raw if raw else _receive_with_client
        received = await receive(address, sampling)
    finally:
        server.stop()
    steps = [float(x) for x in times_path.read_text().split()]
    added = [(r - s) * 1e6 for r, s in zip(received, steps, strict=False)][50:]  # skip warm-up
    return {
        "frames": len(added),
        "added_us_p50": percentile(added, 0.5),
        "added_us_p90": percentile(added, 0.9),
        "added_us_p99": percentile(added, 0.99),
    }


async def _receive_with_client(address: str, sampling: SamplingParams) -> list[float]:
    received: list[float] = []
    async with AsyncClient(address, name="latency", connect_timeout_s=60) as client:
        async for _ in client.generate([10], sampling):
            received.append(time.monotonic())
    return received


async def _receive_raw(address: str, sampling: SamplingParams) -> list[float]:
    """One request over a plain zmq.asyncio DEALER and the codec: no client library."""
    import zmq
    import zmq.asyncio

    from codec import PROTOCOL_VERSION, Generate, Hello, HelloAck, Outputs, decode_server, encode

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    received: list[float] = []
    try:
        sock.connect(address)
        async with asyncio.timeout(120):
            await sock.send_multipart(encode(Hello(PROTOCOL_VERSION, "latency-raw", 30.0)))
            while not isinstance(decode_server(await sock.recv_multipart()), HelloAck):
                pass
            await sock.send_multipart(encode(Generate("raw", [10], True, sampling)))
            while True:
                msg = decode_server(await sock.recv_multipart())
                if type(msg) is Outputs:
                    received.append(time.monotonic())
                    if any(out.finished is not None for out in msg.outputs):
                        return received
    finally:
        sock.close(linger=0)
        ctx.term()


async def _transport_baseline(frames: int) -> dict:
    """One-way latency of a bare ROUTER → DEALER frame, same cadence and client loop."""
    import struct

    import zmq
    import zmq.asyncio

    address = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/baseline.sock"
    server = _Process(
        [
            sys.executable,
            "-m",
            "bench.zmq_baseline",
            "--bind",
            address,
            "--frames",
            str(frames),
            "--interval",
            "0.002",
        ],
        "zmq-baseline.log",
    )
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    latencies = []
    try:
        sock.connect(address)
        await sock.send(b"hello")
        async with asyncio.timeout(60):
            for _ in range(frames):
                (frame,) = await sock.recv_multipart()
                latencies.append((time.monotonic() - struct.unpack("<d", frame)[0]) * 1e6)
    finally:
        sock.close()
        server.stop()
    latencies = latencies[50:]
    return {
        "frames": len(latencies),
        "one_way_us_p50": percentile(latencies, 0.5),
        "one_way_us_p99": percentile(latencies, 0.99),
    }


def _processing_time(iterations: int = 20000) -> dict:
    """Gateway work per output frame, in process: table.on_step, encode, non-blocking send."""
    import timeit

    import zmq

    from codec import VERSION_FRAME, Generate, Hello
    from codec.framing import encode_payload
    from gateway.engine import EngineInfo
    from gateway.fake_engine import FakeEngine, FakeOutput
    from gateway.sessions import SessionTable

    info = EngineInfo("fake", 1 << 20, 50_000, (2,), 20, 1 << 16)
    engine = FakeEngine(info=info)
    table = SessionTable(info, engine.prepare)
    table.on_message(b"c", Hello(1), 0.0)
    table.on_message(b"c", Generate("r1", [10], True, SamplingParams(max_tokens=10**9)), 0.0)
    (engine_id,) = table.live_engine_request_ids()
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.SNDHWM, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"c")
    dealer.setsockopt(zmq.RCVHWM, 0)
    router.bind("inproc://processing")
    dealer.connect("inproc://processing")
    dealer.send(b"hi")
    router.recv_multipart()
    step = [FakeOutput(engine_id, [1234])]

    def one_frame() -> None:
        for client_id, msg in table.on_step(step, 0.0).replies:
            router.send_multipart([client_id, VERSION_FRAME, encode_payload(msg)], zmq.NOBLOCK)

    per_frame = min(timeit.repeat(one_frame, number=iterations, repeat=5)) / iterations * 1e6
    router.close(0)
    dealer.close(0)
    ctx.term()
    return {"us_per_frame": per_frame}


async def measure_ceiling(quick: bool = True) -> dict:
    """Both ceiling measurements; a pyinstrument profile when it is installed."""
    RESULTS.mkdir(exist_ok=True)
    profile = RESULTS / "ceiling_profile.txt"
    has_profiler = importlib.util.find_spec("pyinstrument") is not None
    result: dict = {"throughput": [], "latency": None, "profile": None, "errors": []}
    for streams in [1, 256] if quick else [1, 64, 256, 1024]:
        try:
            row = await _throughput(streams, 3.0 if quick else 8.0, None)
        except Exception as exc:  # reported in the results, not hidden
            result["errors"].append(f"throughput with {streams} streams: {exc!r}")
            continue
        result["throughput"].append(row)
        print(
            f"  ceiling streams={streams:<5} {row['output_tok_s']:9.0f} tok/s  "
            f"{row['tok_s_per_gateway_core'] or 0:9.0f} tok/s per gateway core",
            flush=True,
        )
    if has_profiler:  # a separate run: the profiler's own cost must not lower the figures
        await _throughput(256, 2.0, profile)
    frames = 500 if quick else 3000
    lat = await _frame_latency(frames)
    lat["raw_client"] = await _frame_latency(frames, raw=True)
    lat["transport_baseline"] = await _transport_baseline(frames)
    lat["processing"] = _processing_time()
    result["latency"] = lat
    print(
        f"  ceiling step->client per frame: p50 {lat['added_us_p50']:.0f} us, p99 "
        f"{lat['added_us_p99']:.0f} us; bare zmq one-way p50 "
        f"{lat['transport_baseline']['one_way_us_p50']:.0f} us; bare protocol client p50 "
        f"{lat['raw_client']['added_us_p50']:.0f} us; gateway processing "
        f"{lat['processing']['us_per_frame']:.1f} us/frame",
        flush=True,
    )
    if has_profiler and profile.exists():
        result["profile"] = str(profile.relative_to(RESULTS.parent.parent))
    return result


async def compare_step_latency(rounds: int, frames: int) -> dict:
    """Engine step -> consumer through AsyncClient, through a bare protocol client, and a
    bare pyzmq hop, in alternating rounds (this VM drifts between runs)."""
    kinds = {"client_library": [], "bare_protocol_client": [], "bare_pyzmq_hop": []}
    for r in range(rounds):
        library = await _frame_latency(frames)
        raw = await _frame_latency(frames, raw=True)
        hop = await _transport_baseline(frames)
        kinds["client_library"].append((library["added_us_p50"], library["added_us_p99"]))
        kinds["bare_protocol_client"].append((raw["added_us_p50"], raw["added_us_p99"]))
        kinds["bare_pyzmq_hop"].append((hop["one_way_us_p50"], hop["one_way_us_p99"]))
        print(
            f"  round {r + 1}/{rounds}: p50 AsyncClient {library['added_us_p50']:.0f} µs,"
            f" bare client {raw['added_us_p50']:.0f} µs, bare hop {hop['one_way_us_p50']:.0f} µs",
            flush=True,
        )
    result: dict = {"rounds": rounds, "frames_per_round": frames, "per_round": kinds}
    for name, rows in kinds.items():
        result[name] = {
            "p50_us_median": percentile([p50 for p50, _ in rows], 0.5),
            "p99_us_median": percentile([p99 for _, p99 in rows], 0.5),
        }
    # Medians of per-round p50 differences: the whole path over a bare hop (the issue's
    # target), what the gateway adds to a bare hop, and the library to that.
    for key, path, base in (
        ("client_library_over_hop_p50_us", "client_library", "bare_pyzmq_hop"),
        ("gateway_over_hop_p50_us", "bare_protocol_client", "bare_pyzmq_hop"),
        ("library_over_bare_client_p50_us", "client_library", "bare_protocol_client"),
    ):
        pairs = zip(kinds[path], kinds[base], strict=True)
        result[key] = percentile([a[0] - b[0] for a, b in pairs], 0.5)
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="python -m bench.ceiling",
        description="Engine step -> consumer latency per output frame (fake engine stepping "
        "every 2 ms, one stream, ipc): AsyncClient, a bare protocol client, a bare pyzmq hop.",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--frames", type=int, default=1000)
    p.add_argument("--out", type=Path, default=RESULTS / "step_latency.json")
    args = p.parse_args(argv)
    result = asyncio.run(compare_step_latency(args.rounds, args.frames))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
