"""CPU cost of receiving one ZeroMQ frame at an engine's step cadence on an asyncio
(uvloop) event loop, three ways (bench only): pyzmq's asyncio layer (``await
recv_multipart()`` on a ``zmq.asyncio`` socket: a Future, its bookkeeping and several
``ZMQ_EVENTS`` reads per frame); the same await on that socket adopted by
``gateway.loop_watched_socket.LoopWatchedSocket`` (how the gateway's vLLM adapter has vLLM's
output task receive); and the event loop watching the socket's file descriptor with a
callback that receives with ``NOBLOCK`` itself, as ``client.AsyncClient`` does (no task
to wake).

    python -m bench.probes.recv_cost [--frames 2000] [--bytes 4000] [--interval 0.004] [--rounds 3]

The gateway process receives at least twice per engine step: vLLM's engine client reads
each step's outputs (through LoopWatchedSocket), the gateway's ROUTER each client frame
(through pyzmq's asyncio layer). A PUSH socket in another process sends FRAMES frames of
BYTES bytes over ipc, spaced INTERVAL seconds apart; the receiving thread's CPU time (its
thread clock, the loop's own waits included) is reported per frame, the ways alternating
over ROUNDS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio

from gateway.loop_watched_socket import LoopWatchedSocket

_POLLIN = int(zmq.POLLIN)  # an int: pyzmq's flag enum costs ~1 µs per `&` on Python 3.11


def _source(address: str, frames: int, size: int, interval: float, go: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    payload = b"x" * size
    go.wait(60)  # the receiver is ready
    for _ in range(frames):
        sock.send(payload)
        time.sleep(interval)
    sock.close()  # lingers until every frame is delivered
    ctx.term()


async def _receive_asyncio(sock: zmq.asyncio.Socket, frames: int) -> None:
    for _ in range(frames):
        await sock.recv_multipart()


async def _receive_fd(sock: zmq.Socket, frames: int) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left = [frames]

    def on_readable() -> None:
        while left[0] and sock.getsockopt(zmq.EVENTS) & _POLLIN:
            sock.recv_multipart(zmq.NOBLOCK)
            left[0] -= 1
        if not left[0] and not done.done():
            done.set_result(None)

    fd = sock.getsockopt(zmq.FD)
    loop.add_reader(fd, on_readable)
    try:
        on_readable()  # frames may already wait: the descriptor is edge-triggered
        await done
    finally:
        loop.remove_reader(fd)


async def measure(way: str, frames: int, size: int, interval: float) -> float:
    """The receiving thread's CPU µs per frame, received ``way`` ("asyncio", "watched"
    or "fd")."""
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/recv-cost.sock"
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    spawn = multiprocessing.get_context("spawn")
    go = spawn.Event()
    source = spawn.Process(target=_source, args=(address, frames, size, interval, go))
    source.start()
    try:
        start = time.thread_time()
        go.set()
        if way == "fd":
            await _receive_fd(zmq.Socket.shadow(sock.underlying), frames)
        else:
            if way == "watched":
                sock = LoopWatchedSocket.adopt(sock)
            await _receive_asyncio(sock, frames)
        spent = time.thread_time() - start
    finally:
        source.join(60)
        sock.close(linger=0)
        ctx.term()
    return spent / frames * 1e6


async def compare(frames: int, size: int, interval: float, rounds: int) -> dict:
    runs: dict[str, list[float]] = {"asyncio": [], "watched": [], "fd": []}
    for _ in range(rounds):
        for way in runs:
            runs[way].append(round(await measure(way, frames, size, interval), 1))
    return {
        "frames": frames,
        "bytes": size,
        "interval_s": interval,
        "receiver_us_per_frame": runs,
        "median_us_per_frame": {way: statistics.median(v) for way, v in runs.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.probes.recv_cost", description=__doc__)
    p.add_argument("--frames", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=4000, help="~128 streamed outputs")
    p.add_argument("--interval", type=float, default=0.004, help="~250 engine steps/s")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import uvloop

    result = uvloop.run(compare(args.frames, args.bytes, args.interval, args.rounds))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
