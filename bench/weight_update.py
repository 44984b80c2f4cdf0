"""Time of one weight update through the gateway: in memory (``cpu`` backend, shared-memory
buckets, ``client.weight_sync.send_weights``'s steps) against ``ReloadWeights`` from disk
with the checkpoint write included (what a trainer without weight transfer does), and
against vLLM's own dev-mode HTTP routes making the same in-memory update (``vllm serve``
with the same backend: /pause, /start_weight_update, /update_weights, /finish_weight_update,
/resume, through vLLM's ``HTTPVLLMWeightSyncClient``).

    python -m bench.weight_update --model tiny --rounds 3
    python -m bench.weight_update --model llama-3.2-1b --rounds 3   # random weights, ~2.5 GB

Each round: Pause(keep), the update, Resume, while nothing runs. In memory, split into
start, transfer (write each bucket and UpdateWeights it) and finish; from disk, into
writing the checkpoint (safetensors, to ``--disk-dir``) and ReloadWeights; over HTTP, as in
memory. Results:
``bench/results/weight_update_<model>.md`` (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def model_path(name: str) -> str:
    if name == "tiny":
        from gateway.tiny_model import ensure_tiny_model

        return str(ensure_tiny_model())
    from bench.random_model import GENERATION_CONFIGS, SHAPES, write_random_model

    folder = Path.home() / ".cache" / "engine-gateway" / f"{name}-random"
    if not (folder / "config.json").exists():
        write_random_model(folder, SHAPES[name], GENERATION_CONFIGS[name])
    return str(folder)


def load_tensors(path: str) -> list[tuple[str, object]]:
    from safetensors.torch import load_file

    tensors: dict[str, object] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(file))
    return list(tensors.items())


async def measure(path: str, rounds: int, bucket_bytes: int, disk_dir: str) -> dict:
    from safetensors.torch import save_file

    from client import AsyncClient
    from client.weight_sync import shared_memory_buckets
    from gateway.auth import ControlPolicy
    from gateway.server import Gateway
    from gateway.vllm import VllmEngine, default_engine_args

    args = default_engine_args(
        path,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=512,
        weight_transfer_config={"backend": "cpu"},
    )
    tensors = load_tensors(path)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    engine = await VllmEngine.start(args)
    folder = tempfile.mkdtemp(prefix="eg-wu-")
    gateway = Gateway(engine, f"ipc://{folder}/gw.sock", control=ControlPolicy(open=True))
    serving = asyncio.ensure_future(gateway.serve())
    memory: list[dict] = []
    disk: list[dict] = []
    try:
        await gateway.ready.wait()
        async with AsyncClient(gateway.addresses[0], name="bench-trainer") as gw:
            await gw.init_weight_transfer_engine({})
            for round_ in range(rounds):
                t0 = time.perf_counter()
                await gw.pause("keep")
                await gw.start_weight_update()
                t1 = time.perf_counter()
                with shared_memory_buckets(tensors, bucket_bytes=bucket_bytes) as buckets:
                    for info in buckets:
                        await gw.update_weights(info)
                t2 = time.perf_counter()
                done = await gw.finish_weight_update(f"mem-{round_}")
                await gw.resume()
                t3 = time.perf_counter()
                assert done.result["layers_updated"] == done.result["layers"], done.result
                memory.append(
                    {"start": t1 - t0, "transfer": t2 - t1, "finish": t3 - t2, "total": t3 - t0}
                )
                checkpoint = Path(disk_dir) / f"eg-ckpt-{round_}"
                t0 = time.perf_counter()
                checkpoint.mkdir(parents=True, exist_ok=True)
                save_file(dict(tensors), checkpoint / "model.safetensors")
                os.sync()
                t1 = time.perf_counter()
                await gw.pause("keep")
                await gw.reload_weights(str(checkpoint), version=f"disk-{round_}")
                await gw.resume()
                t2 = time.perf_counter()
                shutil.rmtree(checkpoint)
                disk.append({"write": t1 - t0, "reload": t2 - t1, "total": t2 - t0})
    finally:
        gateway.stop()
        await asyncio.gather(serving, return_exceptions=True)
        await engine.aclose()
        shutil.rmtree(folder, ignore_errors=True)
    return {"bytes": nbytes, "tensors": len(tensors), "memory": memory, "disk": disk}


async def http_side(path: str, rounds: int, bucket_bytes: int) -> list[dict]:
    """The same in-memory update through vLLM's dev-mode HTTP routes."""
    from bench.targets import EngineSetup, HttpTarget

    setup = EngineSetup(
        max_model_len=512, extra_flags=("--weight-transfer-config", '{"backend": "cpu"}')
    )
    target = HttpTarget(path, dev_mode=True, setup=setup)
    try:
        await target.start()
        return await asyncio.to_thread(_http_rounds, target.base, path, rounds, bucket_bytes)
    finally:
        await target.stop()


def _http_rounds(base: str, path: str, rounds: int, bucket_bytes: int) -> list[dict]:
    """Blocking, as vLLM's HTTPVLLMWeightSyncClient (requests) is."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from client.weight_sync import shared_memory_buckets

    tensors = load_tensors(path)
    http = HTTPVLLMWeightSyncClient(base, timeout=600)
    http.init_weight_transfer_engine({})
    rows: list[dict] = []
    for round_ in range(rounds):
        t0 = time.perf_counter()
        requests.post(f"{base}/pause?mode=keep", timeout=60).raise_for_status()
        http.start_weight_update()
        t1 = time.perf_counter()
        with shared_memory_buckets(tensors, bucket_bytes=bucket_bytes) as buckets:
            for info in buckets:
                http.update_weights(info)
        t2 = time.perf_counter()
        http.finish_weight_update(f"http-{round_}")
        requests.post(f"{base}/resume", timeout=60).raise_for_status()
        t3 = time.perf_counter()
        rows.append({"start": t1 - t0, "transfer": t2 - t1, "finish": t3 - t2, "total": t3 - t0})
    return rows


def markdown(name: str, result: dict, args: argparse.Namespace) -> str:
    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows) * 1000

    mem, disk, http = result["memory"], result["disk"], result.get("vllm-http", [])
    gib = result["bytes"] / 2**30
    lines = [
        f"# One weight update, {name} ({gib:.2f} GiB, {result['tensors']} tensors), ms",
        "",
        f"`python -m bench.weight_update --model {name} --rounds {args.rounds}`"
        f" (buckets of {args.bucket_bytes >> 20} MiB, checkpoint written to {args.disk_dir}),"
        " medians; CPU engine, each update between Pause(keep) and Resume.",
        "",
        "| path | total | parts |",
        "|---|---:|---|",
        f"| in memory (`cpu` backend) | {median(mem, 'total'):.0f} | start"
        f" {median(mem, 'start'):.0f}, transfer {median(mem, 'transfer'):.0f}, finish"
        f" {median(mem, 'finish'):.0f} |",
        f"| ReloadWeights from disk | {median(disk, 'total'):.0f} | write"
        f" {median(disk, 'write'):.0f}, reload {median(disk, 'reload'):.0f} |",
        *(
            [
                f"| vLLM HTTP routes, same backend | {median(http, 'total'):.0f} | start"
                f" {median(http, 'start'):.0f}, transfer {median(http, 'transfer'):.0f},"
                f" finish {median(http, 'finish'):.0f} |"
            ]
            if http
            else []
        ),
        "",
        f"In memory: {median(disk, 'total') / median(mem, 'total'):.1f}x faster;"
        f" {result['bytes'] / median(mem, 'transfer') * 1000 / 2**30:.2f} GiB/s through the"
        " transfer.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_update", description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, or a bench.random_model shape name")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-bytes", type=int, default=512 << 20)
    p.add_argument("--disk-dir", default=tempfile.gettempdir())
    p.add_argument("--no-http", action="store_true", help="skip vLLM's HTTP routes")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = model_path(args.model)
    result = asyncio.run(measure(path, args.rounds, args.bucket_bytes, args.disk_dir))
    if not args.no_http:
        result["vllm-http"] = asyncio.run(http_side(path, args.rounds, args.bucket_bytes))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"weight_update_{args.model}.json").write_text(json.dumps(result, indent=1))
    text = markdown(args.model, result, args)
    (args.out / f"weight_update_{args.model}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
