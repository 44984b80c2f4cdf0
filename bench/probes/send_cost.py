"""CPU cost of one ZeroMQ send at an engine's step cadence, against the same sends back
to back (bench only): what one Outputs frame per step costs the sender on this machine,
before any gateway code.

    python -m bench.probes.send_cost [--frames 2000] [--bytes 4000] [--interval 0.004]

A ROUTER sends FRAMES frames of BYTES bytes over ipc to a DEALER in another process, once
spaced INTERVAL seconds apart (zmq's I/O thread has gone back to sleep and must be woken)
and once back to back. Reports CPU µs per send: the sending thread inside send(), and zmq's
I/O threads of the sending process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import threading
import time

import psutil
import zmq


def _sink(address: str, frames: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"sink")
    sock.connect(address)
    sock.send(b"hello")
    for _ in range(frames):
        sock.recv_multipart()
    sock.close(linger=0)
    ctx.term()


def _other_threads_cpu(main_id: int) -> float:
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id != main_id)


def measure(frames: int, size: int, interval: float) -> dict[str, float]:
    """CPU µs per send, spaced by ``interval`` (0: back to back)."""
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/send-cost.sock"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    sink = multiprocessing.get_context("spawn").Process(target=_sink, args=(address, frames))
    sink.start()
    sock.recv_multipart()  # the sink's hello
    payload = b"x" * size
    main_id = threading.get_native_id()
    others0, in_send = _other_threads_cpu(main_id), 0.0
    for _ in range(frames):
        start = time.thread_time()
        sock.send_multipart([b"sink", b"\x01", payload])
        in_send += time.thread_time() - start
        if interval:
            time.sleep(interval)
    others = _other_threads_cpu(main_id) - others0
    sink.join(60)
    sock.close(linger=0)
    ctx.term()
    return {
        "interval_s": interval,
        "sender_thread_us_per_send": round(in_send / frames * 1e6, 1),
        "zmq_io_threads_us_per_send": round(others / frames * 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.probes.send_cost", description=__doc__)
    p.add_argument("--frames", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=4000, help="~128 streamed outputs")
    p.add_argument("--interval", type=float, default=0.004, help="~250 engine steps/s")
    args = p.parse_args()
    rows = [measure(args.frames, args.bytes, interval) for interval in (args.interval, 0.0)]
    print(json.dumps({"frames": args.frames, "bytes": args.bytes, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
