"""Plain pyzmq ROUTER → DEALER one-way latency at the fake engine's cadence (bench only).

    python -m bench.zmq_baseline --bind ADDR --frames N --interval S

Waits for one DEALER's hello, then sends N small frames, one every S seconds,
each carrying the monotonic time it was sent. The same wake-ups and ZeroMQ
I/O-thread hops as a gateway frame, with no gateway code: the transport floor.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import time

import uvloop
import zmq
import zmq.asyncio


async def serve(bind: str, frames: int, interval: float) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(bind)
    identity, _ = await sock.recv_multipart()
    for _ in range(frames):
        await asyncio.sleep(interval)
        sock.send_multipart([identity, struct.pack("<d", time.monotonic())], flags=zmq.NOBLOCK)
    await asyncio.sleep(0.5)
    sock.close(linger=0)
    ctx.term()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", required=True)
    p.add_argument("--frames", type=int, default=500)
    p.add_argument("--interval", type=float, default=0.002)
    args = p.parse_args()
    uvloop.run(serve(args.bind, args.frames, args.interval))


if __name__ == "__main__":
    main()
