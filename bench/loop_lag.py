"""Event-loop lag seen by a well-behaved client while another sends maximal frames.

    python -m bench.loop_lag [--seconds S] [--out bench/results/loop_lag]

Starts a fake-engine gateway (``bench.fake_server``, 8 MiB frame limit) in its
own process. A good client pings every 5 ms and records round trips: alone,
then while an attacker sends 8 MiB frames of two kinds: prompts longer than
``max_prompt_tokens`` (refused from the frame's header) and Generates whose
prompt is fine but whose ``allowed_token_ids`` fills the frame (decoded whole,
then refused). Reports p50/p99/max round trip for each phase, and the ratio to
the quiet phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq

from codec import VERSION_FRAME, Hello, Ping, decode_server, encode

MAX_FRAME = 8 * 1024 * 1024


def _frames(kind: str) -> bytes:
    if kind == "long-prompt":  # 8M one-byte ids: over max_prompt_tokens (1M), refused by header
        return msgspec.msgpack.encode([2, "a", [7] * (MAX_FRAME - 64)])
    # A 1-token prompt, then allowed_token_ids filling the frame (3-byte ints): decoded whole.
    ids = [40_000] * ((MAX_FRAME - 128) // 3)
    return msgspec.msgpack.encode([2, "b", [7], True, {"allowed_token_ids": ids}])


def _pinger(address: str, stop: threading.Event, rtts: list[float]) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    nonce = 0
    while not stop.is_set():
        nonce += 1
        start = time.perf_counter()
        sock.send_multipart(encode(Ping(nonce)))
        while True:
            if not sock.poll(30_000):
                raise TimeoutError("gateway did not answer a ping in 30 s")
            msg = decode_server(sock.recv_multipart())
            if getattr(msg, "nonce", None) == nonce:
                break
        rtts.append(time.perf_counter() - start)
        time.sleep(0.005)
    sock.close()


def _phase(address: str, seconds: float, attack: str | None) -> dict:
    stop, rtts = threading.Event(), []
    pinger = threading.Thread(target=_pinger, args=(address, stop, rtts))
    pinger.start()
    frames_sent = 0
    attacker = None
    if attack is not None:
        attacker = zmq.Context.instance().socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.setsockopt(zmq.SNDHWM, 4)
        attacker.connect(address)
        attacker.send_multipart(encode(Hello(1, "attacker", 60.0)))
        payload = _frames(attack)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if attacker is not None:
            try:
                attacker.send_multipart([VERSION_FRAME, payload], flags=zmq.NOBLOCK)
                frames_sent += 1
            except zmq.Again:
                pass
            while attacker.poll(0):
                attacker.recv_multipart()
        time.sleep(0.001)
    stop.set()
    pinger.join()
    if attacker is not None:
        attacker.close()
    ms = sorted(r * 1000 for r in rtts)
    return {
        "attack": attack or "none",
        "pings": len(ms),
        "attack_frames_sent": frames_sent,
        "rtt_p50_ms": statistics.median(ms),
        "rtt_p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "rtt_max_ms": ms[-1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="per phase")
    p.add_argument("--out", default="bench/results/loop_lag")
    args = p.parse_args()
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-lag-')}/gw.sock"
    server = subprocess.Popen([sys.executable, "-m", "bench.fake_server", "--bind", address])
    try:
        time.sleep(2.0)
        phases = [_phase(address, args.seconds, a) for a in (None, "long-prompt", "full-decode")]
    finally:
        server.terminate()
        server.wait(10)
    quiet = phases[0]
    for phase in phases:
        phase["p99_vs_quiet"] = phase["rtt_p99_ms"] / quiet["rtt_p99_ms"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"phases": phases}, indent=2))
    lines = [
        "| attacker sends | 8 MiB frames sent | ping p50 ms | p99 ms | max ms | p99 vs quiet |",
        "|---|---|---|---|---|---|",
    ]
    for ph in phases:
        lines.append(
            f"| {ph['attack']} | {ph['attack_frames_sent']} | {ph['rtt_p50_ms']:.2f} |"
            f" {ph['rtt_p99_ms']:.2f} | {ph['rtt_max_ms']:.2f} | {ph['p99_vs_quiet']:.1f}x |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
