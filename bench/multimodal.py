"""One image per request: the gateway (processed tensors over the socket, repeats by hash)
beside vLLM's HTTP chat completions with the image as base64 (the route vision-language RL
uses today), on the same model and engine flags, one request at a time.

    python -m bench.multimodal [--requests 32] [--image-size 448] [--model PATH]

Workloads, each on every frontend:
- ``fresh``: every request has its own image;
- ``repeated``: groups of 8 requests share an image (a GRPO group), with other text each.
The gateway runs twice for ``repeated``: by hash (the client's default: tensors once per
session) and resent (tensors every time). Reports per request: time to first token (from
send; the gateway's client-side processing, timed apart, is what the trainer does once per
image), bytes the client sent, the frontend process's CPU, and the engines' encoder runs.
Default model: the tiny Idefics3 (images resized to 112 px and cut into 5 tiles).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from client import AsyncClient, SamplingParams

from .engine_counters import frontend_cpu_seconds
from .targets import GatewayServer, _free_port, _Process, wait_http_healthy

RESULTS = Path(__file__).resolve().parent / "results"
GROUP = 8
MAX_TOKENS = 8
ENGINE = ["--enforce-eager", "--gpu-memory-utilization", "0.2", "--max-model-len", "1024"]
ENGINE += ["--block-size", "32", "--limit-mm-per-prompt", '{"image": 2}']
# vLLM's "string" content format puts the model's image placeholder before the text.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _images(count: int, size: int, repeated: bool, seeds: int) -> list:
    """Images from seeds ``seeds``, ``seeds + 1``, ...: each run its own, so that no run finds
    another's images in the engine's encoder cache."""
    import numpy as np
    from PIL import Image

    images = []
    for i in range(count):
        seed = seeds + (i // GROUP if repeated else i)
        rs = np.random.RandomState(seed)
        # A smooth gradient with noise: photo-like compression, not a worst case.
        ramp = np.linspace(0, 255, size)[None, :, None] * rs.rand(1, 1, 3)
        pixels = np.clip(ramp + rs.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
        images.append(Image.fromarray(pixels))
    return images


def _jpeg_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return base64.b64encode(buffer.getvalue()).decode()


async def _gateway_run(server: GatewayServer, processor, images, by_hash: bool) -> dict:
    from codec import encode_payload

    cpu = frontend_cpu_seconds
    async with AsyncClient(server.ipc, connect_timeout_s=300) as client:
        sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        before = await client.stats()
        cpu0 = cpu(server.process.pid)
        ttft, process_s, sent_bytes = [], [], []
        for i, image in enumerate(images):
            start = time.perf_counter()
            prompt, items = processor([50 + i % 400, 6, 60], [image])
            process_s.append(time.perf_counter() - start)
            if not by_hash:
                client._multimodal_sent.clear()  # as a client without send-once
            known = set(client._multimodal_sent)
            message = client._by_hash(client.generate(prompt, sampling, multimodal=items)._message)
            client._multimodal_sent = known  # as it was: the request below sends it
            sent_bytes.append(len(encode_payload(message)))
            start = time.perf_counter()
            first = None
            async for _ in client.generate(prompt, sampling, multimodal=items):
                first = first or time.perf_counter()
            ttft.append(first - start)
        after = await client.stats()
        cpu1 = cpu(server.process.pid)
    g0, g1 = before.gateway, after.gateway
    return _summary(
        ttft,
        sent_bytes,
        (cpu1 - cpu0) / len(images),
        g1["encoder_runs"] - g0["encoder_runs"],
        client_process_ms=statistics.median(process_s) * 1e3,
        by_hash=g1["multimodal_items_by_hash"] - g0["multimodal_items_by_hash"],
    )


class ChatServer:
    """`vllm serve MODEL` (OpenAI chat completions) on the same engine flags."""

    def __init__(self, model: str):
        folder = Path(tempfile.mkdtemp(prefix="eg-bench-"))
        (folder / "template.jinja").write_text(CHAT_TEMPLATE)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        self.process = _Process(
            [
                sys.executable, "-m", "bench.vllm_cli", "serve", model, "--host", "127.0.0.1",
                "--port", str(self.port), "--disable-log-stats", "--uvicorn-log-level", "warning",
                "--chat-template", str(folder / "template.jinja"), *ENGINE,
            ],
            "vllm-serve.log",
        )  # fmt: skip


async def _http_run(server: ChatServer, model: str, images) -> dict:
    import aiohttp

    await wait_http_healthy(server.port, server.process)
    async with aiohttp.ClientSession() as session:
        cpu0 = frontend_cpu_seconds(server.process.pid)
        ttft, sent_bytes = [], []
        for i, image in enumerate(images):
            url = "data:image/jpeg;base64," + _jpeg_b64(image)
            body = json.dumps(
                {
                    "model": model,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": url}},
                                {"type": "text", "text": f"t{50 + i % 400} t60"},
                            ],
                        }
                    ],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                }
            ).encode()
            sent_bytes.append(len(body))
            start = time.perf_counter()
            first = None
            async with session.post(
                server.url, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        choices = json.loads(line[6:]).get("choices") or [{}]
                        if choices[0].get("delta", {}).get("content"):
                            first = time.perf_counter()
            ttft.append((first or time.perf_counter()) - start)
        cpu1 = frontend_cpu_seconds(server.process.pid)
    return _summary(ttft, sent_bytes, (cpu1 - cpu0) / len(images), None)


def _summary(ttft, sent, cpu_per_request, encoder_runs, **extra) -> dict:
    ordered = sorted(ttft)
    return {
        "requests": len(ttft),
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "bytes_per_request": statistics.mean(sent),
        "frontend_cpu_ms_per_request": cpu_per_request * 1e3,
        "encoder_runs": encoder_runs,
        **extra,
    }


def _markdown(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "# One image per request: gateway vs vLLM HTTP chat completions (base64 JPEG)",
        "",
        f"`python -m bench.multimodal --requests {args.requests} --image-size"
        f" {args.image_size}`; model: {Path(args.model).name}; {MAX_TOKENS} greedy tokens,"
        " one request at a time; `repeated`: groups of 8 requests share an image.",
        "",
        "| workload | frontend | TTFT p50 ms | TTFT p90 ms | bytes sent / request |"
        " frontend CPU ms / request | encoder runs | client processing ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        workload, frontend = key.split("/")
        runs = "-" if r["encoder_runs"] is None else str(r["encoder_runs"])
        lines.append(
            f"| {workload} | {frontend} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} |"
            f" {r['bytes_per_request']:,.0f} | {r['frontend_cpu_ms_per_request']:.2f} | {runs} |"
            f" {r.get('client_process_ms', 0):.1f} |"
        )
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> dict:
    from client.multimodal_processor import MultimodalProcessor

    processor = MultimodalProcessor(args.model)
    n, size = args.requests, args.image_size
    warm, fresh = _images(4, size, False, 10_000), _images(n, size, False, 20_000)
    grouped = [_images(n, size, True, base) for base in (30_000, 40_000)]
    results: dict[str, dict] = {}
    gateway = GatewayServer(args.model, ("--control-open", *ENGINE[3:]), _Setup())
    try:
        await _gateway_run(gateway, processor, warm, by_hash=True)
        results["fresh/gateway"] = await _gateway_run(gateway, processor, fresh, True)
        results["repeated/gateway by hash"] = await _gateway_run(
            gateway, processor, grouped[0], True
        )
        results["repeated/gateway resent"] = await _gateway_run(
            gateway, processor, grouped[1], False
        )
    finally:
        gateway.stop()
    http = ChatServer(args.model)
    try:
        await _http_run(http, args.model, warm)
        results["fresh/vllm-http"] = await _http_run(http, args.model, fresh)
        results["repeated/vllm-http"] = await _http_run(http, args.model, grouped[0])
    finally:
        http.process.stop()
    return results


class _Setup:
    """The gateway's engine flags (those the chat server gets too)."""

    flags = ENGINE[:3]
    env: dict[str, str] = {}


def main() -> None:
    from gateway.tiny_model import ensure_tiny_vlm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--model", default=None, help="default: the tiny Idefics3")
    parser.add_argument("--out", default="multimodal")
    args = parser.parse_args()
    args.model = args.model or str(ensure_tiny_vlm())
    results = asyncio.run(main_async(args))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2))
    text = _markdown(results, args)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
