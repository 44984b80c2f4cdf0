"""``python -m bench.frameworks``: the RL frameworks' own clients, side by side, one run.

For TRL, SkyRL and verifiers: the framework's HTTP client against ``vllm serve`` (where it
works: renderers 0.1.12 cannot read vllm serve 0.32's logprobs) and against the HTTP face
over a gateway, and the native adapter (``client.frameworks``) over the gateway's socket.
Each is a batch of greedy requests sent at once, as a trainer's, timed in its framework's
venv (``bench/framework_clients.py``): output tok/s and the trainer process's CPU per
token. Then TRL's weight sync through the native client beside a checkpoint write and
ReloadWeights. Medians over interleaved rounds; ``bench/results/frameworks.{json,md}``.

    python -m bench.frameworks --prompts 64 --output-len 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .targets import (
    ROOT,
    EngineSetup,
    GatewayServer,
    _free_port,
    _Process,
    wait_http_healthy,
)

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = [
    ("trl", ".venv-trl", ["http:vllm", "http:face", "native"]),
    ("skyrl", ".venv-skyrl", ["http:vllm", "http:face", "native"]),
    ("verifiers", ".venv-verifiers", ["http:face", "native"]),
]


def _client(venv: str, kind: str, target: str, model: str, tokenizer: str, args) -> dict:  # noqa: ANN001
    done = subprocess.run(
        [str(ROOT / venv / "bin" / "python"), "-m", "bench.framework_clients",
         kind, target, model, tokenizer, str(args.prompts), str(args.output_len)],
        capture_output=True, text=True, timeout=600, cwd="/",
        env={**os.environ, "PYTHONPATH": str(ROOT), "ENGINE_GATEWAY_BENCH_TOKEN": "unused"},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{venv} {kind}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.frameworks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="frameworks")
    args = parser.parse_args(argv)

    from gateway.tiny_model import ensure_tiny_model, ensure_tiny_tokenizer

    model, tokenizer = str(ensure_tiny_model()), str(ensure_tiny_tokenizer())
    setup = EngineSetup()
    gateway = GatewayServer(model, ("--control-open", "--weight-transfer-config",
                                    '{"backend": "cpu"}'), setup=setup)  # fmt: skip
    vllm_port, face_port = _free_port(), _free_port()
    vllm = _Process(
        [sys.executable, "-m", "bench.vllm_cli", "serve", model, "--host", "127.0.0.1",
         "--port", str(vllm_port), "--enable-scale-out", "--disable-log-stats",
         "--uvicorn-log-level", "warning", *setup.flags],
        "vllm-serve.log", env={"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    face = _Process(
        [sys.executable, "-m", "client.http_face", "--gateway", gateway.ipc, "--port",
         str(face_port), "--connect-timeout", "300", "--max-in-flight-per-caller", "1000000"],
        "http-face.log",
    )  # fmt: skip
    targets = {
        "http:vllm": f"http://127.0.0.1:{vllm_port}",
        "http:face": f"http://127.0.0.1:{face_port}",
        "native": gateway.ipc,
    }
    rows: dict[tuple[str, str], list[dict]] = {}
    try:
        import asyncio

        asyncio.run(wait_http_healthy(vllm_port, vllm))
        asyncio.run(wait_http_healthy(face_port, face))
        plan = [(f, v, t) for f, v, ts in KINDS for t in ts]
        for round_ in range(args.rounds):
            random.Random(round_).shuffle(plan)
            for framework, venv, target in plan:
                kind = f"{framework}-{'http' if target.startswith('http') else 'native'}"
                result = _client(venv, kind, targets[target], model, tokenizer, args)
                rows.setdefault((framework, target), []).append(result)
                print(f"  round {round_ + 1}/{args.rounds} {framework:9} {target:9}"
                      f" {result['tokens'] / result['wall_s']:8.0f} tok/s"
                      f" {1e6 * result['cpu_s'] / result['tokens']:7.1f} µs CPU/token",
                      flush=True)  # fmt: skip
        syncs = [_client(".venv-trl", "trl-sync", gateway.ipc, model, tokenizer, args)
                 for _ in range(args.rounds)]  # fmt: skip
    finally:
        face.stop()
        vllm.stop()
        gateway.stop()
    report = _report(rows, syncs, args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(report)
    summary = {f"{f} {t}": r for (f, t), r in rows.items()}
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"runs": summary, "syncs": syncs},
                                                          indent=1))  # fmt: skip
    print(report)
    return 0


_NAMES = {"http:vllm": "its HTTP client, vllm serve", "http:face": "its HTTP client, the face",
          "native": "native adapter, socket"}  # fmt: skip


def _report(rows: dict, syncs: list[dict], args) -> str:  # noqa: ANN001
    lines = [
        f"# RL frameworks' clients side by side ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"`python -m bench.frameworks --prompts {args.prompts} --output-len {args.output_len}"
        f" --rounds {args.rounds}`: {args.prompts} greedy requests of 64 prompt and"
        f" {args.output_len} output tokens sent at once (a trainer's batch), the tiny model,"
        " medians over interleaved rounds. Trainer CPU: the framework client's process.",
        "",
        "| framework | client, server | output tok/s | trainer CPU µs / token |",
        "|---|---|---|---|",
    ]
    order = [(f, t) for f, _, ts in KINDS for t in ts]
    for framework, target in sorted(rows, key=order.index):
        results = rows[(framework, target)]
        rate = statistics.median(r["tokens"] / r["wall_s"] for r in results)
        cpu = statistics.median(1e6 * r["cpu_s"] / r["tokens"] for r in results)
        lines.append(f"| {framework} | {_NAMES[target]} | {rate:.0f} | {cpu:.1f} |")
    push = statistics.median(s["push_s"] for s in syncs)
    write = statistics.median(s["write_s"] for s in syncs)
    reload = statistics.median(s["reload_s"] for s in syncs)
    lines += [
        "",
        "TRL weight sync of the tiny model (medians): push through the native client"
        f" {1e3 * push:.0f} ms; checkpoint write {1e3 * write:.0f} ms + ReloadWeights"
        f" {1e3 * reload:.0f} ms = {1e3 * (write + reload):.0f} ms.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
