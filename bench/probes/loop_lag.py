"""Event-loop lag seen by a well-behaved client while another sends maximal frames.

    python -m bench.probes.loop_lag [--seconds S] [--max-model-len N] [--out bench/results/loop_lag]

Starts a fake-engine gateway (``bench.fake_server``) for a model of ``max_model_len``
tokens, with the default frame limit that follows from it (``frame_limit_for``: 5 bytes a
token + 64 KiB) in its own process. A good client pings every 5 ms and records round
trips: alone, then while an attacker sends maximal frames of three kinds: prompts longer
than ``max_prompt_tokens`` (refused from the frame's header), Generates whose prompt is
fine but whose ``allowed_token_ids`` fills the frame (decoded whole, then refused), and
valid Generates of a whole context of 5-byte ids (decoded, validated and run). Reports
p50/p99/max round trip for each phase, and the ratio to the quiet phase.
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
from gateway.sessions import frame_limit_for

VOCAB = 200_000  # ids above 65,535 take msgpack's 5 bytes, the most a token id takes


def _frames(kind: str, max_model_len: int, frame_limit: int) -> list[bytes]:
    """Frames of one kind, each as large as the limit lets it be (several: distinct ids)."""
    if kind == "long-prompt":  # one-byte ids over max_prompt_tokens: refused by the header
        return [msgspec.msgpack.encode([2, "a", [7] * (frame_limit - 64)])]
    if kind == "full-decode":  # 1-token prompt, allowed_token_ids (3-byte ints) to the limit
        ids = [40_000] * ((frame_limit - 128) // 3)
        return [msgspec.msgpack.encode([2, "b", [7], True, {"allowed_token_ids": ids}])]
    # Valid: a whole context of 5-byte ids (a 200k vocabulary's top ids), 1 new token.
    prompt = [VOCAB - 1] * (max_model_len - 1)
    return [
        msgspec.msgpack.encode([2, f"v{i}", prompt, False, {"max_tokens": 1}]) for i in range(64)
    ]


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


def _phase(
    address: str, seconds: float, attack: str | None, max_model_len: int, frame_limit: int
) -> dict:
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
        payloads = _frames(attack, max_model_len, frame_limit)
        assert all(len(p) <= frame_limit for p in payloads), attack
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if attacker is not None:
            try:
                payload = payloads[frames_sent % len(payloads)]
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
        "frame_bytes": max((len(p) for p in payloads), default=0) if attack else 0,
        "rtt_p50_ms": statistics.median(ms),
        "rtt_p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        "rtt_max_ms": ms[-1],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0, help="per phase")
    p.add_argument("--max-model-len", type=int, default=131_072, help="the served model's")
    p.add_argument("--out", default="bench/results/loop_lag")
    args = p.parse_args()
    frame_limit = frame_limit_for(args.max_model_len)
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-lag-')}/gw.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_server", "--bind", address]
        + ["--max-model-len", str(args.max_model_len), "--vocab-size", str(VOCAB)]
    )
    try:
        time.sleep(2.0)
        phases = [
            _phase(address, args.seconds, a, args.max_model_len, frame_limit)
            for a in (None, "long-prompt", "full-decode", "max-valid")
        ]
    finally:
        server.terminate()
        server.wait(10)
    quiet = phases[0]
    for phase in phases:
        phase["p99_vs_quiet"] = phase["rtt_p99_ms"] / quiet["rtt_p99_ms"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    setting = {"max_model_len": args.max_model_len, "max_frame_bytes": frame_limit}
    out.with_suffix(".json").write_text(json.dumps({**setting, "phases": phases}, indent=2))
    lines = [
        f"max_model_len {args.max_model_len}, default max_frame_bytes {frame_limit}",
        "",
        "| attacker sends | frame bytes | frames sent | ping p50 ms | p99 ms | max ms |"
        " p99 vs quiet |",
        "|---|---|---|---|---|---|---|",
    ]
    for ph in phases:
        lines.append(
            f"| {ph['attack']} | {ph['frame_bytes']} | {ph['attack_frames_sent']} |"
            f" {ph['rtt_p50_ms']:.2f} |"
            f" {ph['rtt_p99_ms']:.2f} | {ph['rtt_max_ms']:.2f} | {ph['p99_vs_quiet']:.1f}x |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
