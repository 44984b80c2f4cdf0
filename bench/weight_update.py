"""Time of one weight update through the gateway: in memory (``cpu`` backend, shared-memory
buckets, ``client.weight_sync.send_weights``'s steps) against ``ReloadWeights`` from disk
with the checkpoint write included (what a trainer without weight transfer does), and
against vLLM's own dev-mode HTTP routes making the same in-memory update (``vllm serve``
with the same backend: /pause, /start_weight_update, /update_weights, /finish_weight_update,
/resume, through vLLM's ``HTTPVLLMWeightSyncClient``).

    python -m bench.weight_update --model tiny --rounds 3
    python -m bench.weight_update --model llama-3.2-1b --rounds 3   # random weights, ~2.5 GB

Each round, while nothing runs: in memory, the update holding generation with keep (its
hold ends with the update), then from disk (rounds interleaved), then over HTTP between
Pause(keep) and Resume. In memory, split into start, transfer (write each bucket and
UpdateWeights it; within it, the trainer's copy-in and the workers' load) and finish; from
disk, into writing the checkpoint (safetensors, to ``--disk-dir``) and ReloadWeights; over
HTTP, as in memory; and one plain memcpy of the same bytes, for scale. ``--arena-mb``
(the gateway's arena; 0: buffer files), ``--lora`` (an adapter loaded) and
``--data-parallel-size`` vary the setup. Results:
``bench/results/weight_update_<model>[_lora][_dp2][_files].md`` (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
_HTTP_FOLDER = "/dev/shm/eg-bench-http-weights"  # vLLM's server alone: the bench names it
_TRANSFER_FLAGS = ("--weight-transfer-config", '{"backend": "cpu"}')


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


async def measure(
    path: str,
    rounds: int,
    bucket_bytes: int,
    disk_dir: str,
    http: bool,
    *,
    arena_mb: int = 1024,
    lora: bool = False,
    data_parallel_size: int = 1,
) -> dict:
    """The gateway's rounds (``python -m gateway serve``; in memory, then from disk), then
    vLLM's HTTP routes' rounds (``vllm serve``); each server alone on the machine (two idle
    CPU engines side by side slow each other's updates several-fold on 2 cores), after one
    round not counted. The trainer is this process. ``arena_mb``: the gateway's
    ``--weight-arena-mb`` (0: buffer files); ``lora``: an adapter loaded (and used) first;
    ``data_parallel_size``: engines that all load every update."""
    from bench.targets import EngineSetup, GatewayServer
    from client import AsyncClient
    from client.weight_sync import buffer_arena, buffer_folder

    flags = list(_TRANSFER_FLAGS)
    if lora:
        flags += ["--enable-lora", "--max-lora-rank", "8"]
    setup = EngineSetup(
        max_model_len=512, extra_flags=tuple(flags), data_parallel_size=data_parallel_size
    )
    tensors = load_tensors(path)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    result: dict = {"bytes": nbytes, "tensors": len(tensors), "memory": [], "disk": []}
    result["memcpy"] = memcpy_seconds(nbytes)
    result["memcpy_one_thread"] = memcpy_seconds(nbytes, threads=1)
    result["setup"] = {"arena_mb": arena_mb, "lora": lora, "data_parallel_size": data_parallel_size}
    server = GatewayServer(
        path,
        extra_flags=("--control-open", "--weight-arena-mb", str(arena_mb)),
        setup=setup,
    )
    try:
        async with AsyncClient(
            server.ipc, name="bench-trainer", connect_timeout_s=300, heartbeat_interval_s=5.0
        ) as gw:
            if lora:
                await _load_adapter(gw, path)
            init = await gw.init_weight_transfer_engine({})
            folder, arena = buffer_folder(init), buffer_arena(init)
            result["arena_bytes"] = arena[1] if arena else 0
            # Interleaved (the VM's memory speed drifts over minutes); each checkpoint write
            # is synced before its reload, and removed after it.
            memory, disk = [], []
            for r in range(rounds + 1):
                memory.append(await _in_memory(gw, tensors, bucket_bytes, folder, arena, r))
                disk.append(await _from_disk(gw, tensors, disk_dir, r))
            result["memory"], result["disk"] = memory[1:], disk[1:]  # the first warms up
    finally:
        server.stop()
    if http:
        target = _http_target(path)
        try:
            await target.start()
            rows = [
                await asyncio.to_thread(_http_round, target.base, tensors, bucket_bytes, r)
                for r in range(rounds + 1)
            ]
            result["vllm-http"] = rows[1:]
        finally:
            await target.stop()
            shutil.rmtree(_HTTP_FOLDER, ignore_errors=True)
    return result


async def _in_memory(  # noqa: ANN001
    gw, tensors: list, bucket_bytes: int, folder: str, arena: tuple | None, round_: int
) -> dict:
    from client.weight_sync import shared_memory_buckets

    loading = 0.0
    t0 = time.perf_counter()
    await gw.start_weight_update("keep")  # the gateway's hold ends with the update
    t1 = time.perf_counter()
    with shared_memory_buckets(
        tensors, bucket_bytes=bucket_bytes, directory=folder, arena=arena
    ) as buckets:
        for info in buckets:
            sent = time.perf_counter()
            await gw.update_weights(info)
            loading += time.perf_counter() - sent
        copy_in = buckets.write_seconds
    t2 = time.perf_counter()
    done = await gw.finish_weight_update(f"mem-{round_}")
    t3 = time.perf_counter()
    assert done.result["layers_updated"] == done.result["layers"], done.result
    return {
        "start": t1 - t0,
        "transfer": t2 - t1,
        "copy_in": copy_in,  # the trainer copying tensors into shared memory
        "load": loading,  # UpdateWeights calls: the workers loading them
        "finish": t3 - t2,
        "total": t3 - t0,
    }


async def _load_adapter(gw, path: str) -> None:  # noqa: ANN001
    """A random rank-8 adapter for the model, loaded and used once."""
    from bench.random_model import write_random_lora
    from codec import RequestOptions, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="eg-bench-lora-"))
    write_random_lora(Path(path), folder, b_scale=0.01)
    await gw.load_lora("bench-adapter", str(folder))
    stream = gw.generate(
        [1, 2, 3], SamplingParams(max_tokens=2), options=RequestOptions(lora_name="bench-adapter")
    )
    async for _ in stream:
        pass


def memcpy_seconds(nbytes: int, chunk: int = 256 << 20, threads: int | None = None) -> float:
    """One plain copy of ``nbytes`` between buffers already in memory (torch's copy_,
    through a ``chunk`` at a time, on ``threads`` threads: torch's default, every core),
    best of 3: what moving the weights once costs here."""
    import torch

    if threads is not None:
        default = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return memcpy_seconds(nbytes, chunk)
        finally:
            torch.set_num_threads(default)
    chunk = min(chunk, max(nbytes, 1))
    source = torch.ones(chunk, dtype=torch.uint8)
    target = torch.zeros(chunk, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        started, left = time.perf_counter(), nbytes
        while left > 0:
            size = min(chunk, left)
            target[:size].copy_(source[:size])
            left -= size
        best = min(best, time.perf_counter() - started)
    return best


async def _from_disk(gw, tensors: list, disk_dir: str, round_: int) -> dict:  # noqa: ANN001
    from safetensors.torch import save_file

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
    return {"write": t1 - t0, "reload": t2 - t1, "total": t2 - t0}


def _http_target(path: str):  # noqa: ANN202
    from bench.targets import EngineSetup, HttpTarget

    setup = EngineSetup(max_model_len=512, extra_flags=_TRANSFER_FLAGS)
    return HttpTarget(path, dev_mode=True, setup=setup)


def _http_round(base: str, tensors: list, bucket_bytes: int, round_: int) -> dict:
    """The same in-memory update through vLLM's dev-mode HTTP routes, blocking, as vLLM's
    HTTPVLLMWeightSyncClient (requests) is."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from client.weight_sync import shared_memory_buckets

    http = HTTPVLLMWeightSyncClient(base, timeout=600)
    # No gateway here: the operator (this bench) names a private folder to vLLM directly.
    folder = _HTTP_FOLDER
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if round_ == 0:
        http.init_weight_transfer_engine({"directory": folder})
    t0 = time.perf_counter()
    requests.post(f"{base}/pause?mode=keep", timeout=60).raise_for_status()
    http.start_weight_update()
    t1 = time.perf_counter()
    with shared_memory_buckets(tensors, bucket_bytes=bucket_bytes, directory=folder) as buckets:
        for info in buckets:
            http.update_weights(info)
    t2 = time.perf_counter()
    http.finish_weight_update(f"http-{round_}")
    requests.post(f"{base}/resume", timeout=60).raise_for_status()
    t3 = time.perf_counter()
    return {"start": t1 - t0, "transfer": t2 - t1, "finish": t3 - t2, "total": t3 - t0}


def markdown(name: str, result: dict, args: argparse.Namespace) -> str:
    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows) * 1000

    def rate(rows: list[dict], key: str) -> str:
        return f"{result['bytes'] / 2**30 / (median(rows, key) / 1000):.2f} GiB/s"

    mem, disk, http = result["memory"], result["disk"], result.get("vllm-http", [])
    gib = result["bytes"] / 2**30
    setup = result.get("setup", {})
    memcpy_ms = result["memcpy"] * 1000
    arena = setup.get("arena_mb", 0)
    where = f"a {arena} MiB arena" if arena else "buffer files"
    lines = [
        f"# One weight update, {name} ({gib:.2f} GiB, {result['tensors']} tensors), ms",
        "",
        f"`python -m bench.weight_update {' '.join(args.argv)}`"
        f" (buckets of at most {args.bucket_bytes >> 20} MiB in {where}; checkpoint written to"
        f" {args.disk_dir}; LoRA adapter loaded: {'yes' if setup.get('lora') else 'no'}; data"
        f" parallel size {setup.get('data_parallel_size', 1)}), medians of {args.rounds} rounds"
        " after one not counted; CPU engine; in memory the update holds generation (keep)"
        " itself, from disk and over HTTP between Pause(keep) and Resume; the gateway's rounds,"
        " then vLLM's server's (each alone on the machine).",
        "",
        "| path | total | parts |",
        "|---|---:|---|",
        f"| gateway, in memory (`cpu` backend) | {median(mem, 'total'):.0f} | start"
        f" {median(mem, 'start'):.0f}, transfer {median(mem, 'transfer'):.0f}, finish"
        f" {median(mem, 'finish'):.0f} |",
        f"| gateway, ReloadWeights from disk | {median(disk, 'total'):.0f} | write"
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
        f"| one plain memcpy of the same bytes | {memcpy_ms:.0f} | best of 3, torch's copy_ on"
        f" every core ({result['memcpy_one_thread'] * 1000:.0f} on one) |",
        "",
        "Phases of the in-memory update (the trainer's copy-in runs on a thread, beside the"
        " workers' load of the bucket before):",
        "",
        "| phase | ms | rate |",
        "|---|---:|---:|",
        f"| trainer copy-in | {median(mem, 'copy_in'):.0f} | {rate(mem, 'copy_in')} |",
        f"| workers' load (UpdateWeights calls) | {median(mem, 'load'):.0f} |"
        f" {rate(mem, 'load')} |",
        f"| finish (layers built, KV cache scrubbed) | {median(mem, 'finish'):.0f} |"
        f" {rate(mem, 'finish')} |",
        f"| whole update | {median(mem, 'total'):.0f} | {rate(mem, 'total')} |",
        "",
        f"In memory through the gateway: {median(disk, 'total') / median(mem, 'total'):.2f}x"
        f" faster than a checkpoint write and reload; {median(mem, 'total') / memcpy_ms:.2f}x"
        " the time of one memcpy"
        + (
            f"; {median(http, 'total') / median(mem, 'total'):.2f}x faster than vLLM's HTTP routes"
            if http
            else ""
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_update", description=__doc__)
    p.add_argument("--model", default="tiny", help="tiny, or a bench.random_model shape name")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-bytes", type=int, default=512 << 20)
    p.add_argument("--disk-dir", default=tempfile.gettempdir())
    p.add_argument("--no-http", action="store_true", help="skip vLLM's HTTP routes")
    p.add_argument(
        "--arena-mb", type=int, default=1024, help="the gateway's --weight-arena-mb (0: files)"
    )
    p.add_argument("--lora", action="store_true", help="load and use a LoRA adapter first")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = model_path(args.model)
    result = asyncio.run(
        measure(
            path,
            args.rounds,
            args.bucket_bytes,
            args.disk_dir,
            http=not args.no_http,
            arena_mb=args.arena_mb,
            lora=args.lora,
            data_parallel_size=args.data_parallel_size,
        )
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"weight_update_{args.model}" + "".join(
        suffix
        for suffix, on in (
            ("_lora", args.lora),
            (f"_dp{args.data_parallel_size}", args.data_parallel_size > 1),
            ("_files", args.arena_mb == 0),
        )
        if on
    )
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    text = markdown(args.model, result, args)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    from gateway.quick_exit import exit_now

    exit_now(main())  # without the teardown: vLLM's imports made it slow and noisy
