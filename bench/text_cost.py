"""What text costs: the client's CPU per generated token with text on (client.text:
incremental detokenization and stop strings) and off, against vLLM's OpenAI-compatible HTTP
server producing the same text; and the throughput at high concurrency with text on and off.

    python -m bench.text_cost [--requests 256] [--concurrency 64] [--max-tokens 128] [--rounds 3]

The tiny model with its byte-level BPE (gateway.tiny_model.ensure_tiny_tokenizer). Every
request: random prompt ids, greedy, ``ignore_eos``, MAX_TOKENS tokens, streamed, with stop
strings that do not occur in the text (so every request does the whole work: each token
detokenized and the stop strings checked on its text). First the gateway alone, text off
and on alternating over ROUNDS (this process is the client: its CPU time is the client's
cost), at CONCURRENCY and at 256; then ``vllm serve`` alone with the tokenizer, the same
requests over ``/v1/completions`` (prompt as ids, the ids returned, the same stop strings),
its frontend processes' CPU (everything but the engine) per token. The texts of the two are
compared. Result: bench/results/text_cost.md (and .json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
STOPS = ["</answer>", "\nObservation:", "§§"]  # never produced here: the whole work each time


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(count)]


async def _gateway_round(
    address: str, tokenizer: Any, prompts: list[list[int]], max_tokens: int, concurrency: int,
    text_on: bool,
) -> dict[str, Any]:  # fmt: skip
    from client import AsyncClient, SamplingParams
    from client.text import AsyncTextClient, TextParams

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    params = TextParams(stop=STOPS)
    texts: dict[int, str] = {}
    tokens = 0
    async with AsyncClient(address, name="text-bench", heartbeat_interval_s=5.0) as client:
        text_client = AsyncTextClient(client, tokenizer)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: list[int]) -> None:
            nonlocal tokens
            async with gate:
                if text_on:
                    parts = []
                    async for out in text_client.generate(prompt, sampling, params):
                        tokens += len(out.token_ids)
                        parts.append(out.text)
                    texts[i] = "".join(parts)
                else:
                    async for out in client.generate(prompt, sampling):
                        tokens += len(out.new_token_ids)

        cpu, start = _client_cpu_s(), time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall, cpu = time.perf_counter() - start, _client_cpu_s() - cpu
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "texts": texts}


async def _http_round(
    port: int, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
    server_pid: int,
) -> dict[str, Any]:  # fmt: skip
    import aiohttp

    from bench.engine_counters import frontend_cpu_seconds

    url = f"http://127.0.0.1:{port}/v1/completions"
    texts: dict[int, str] = {}
    tokens = 0
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: list[int]) -> None:
            nonlocal tokens
            body = {
                "model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stop": STOPS, "stream": True,
                "return_token_ids": True,
            }  # fmt: skip
            parts = []
            async with gate, session.post(url, json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        parts.append(choice["text"])
                        tokens += len(choice.get("token_ids") or ())
            texts[i] = "".join(parts)

        cpu, start = frontend_cpu_seconds(server_pid), time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        wall, cpu = time.perf_counter() - start, frontend_cpu_seconds(server_pid) - cpu
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "texts": texts}


def _per_token_us(rounds: list[dict[str, Any]]) -> float:
    return statistics.median(r["cpu_s"] / r["tokens"] * 1e6 for r in rounds)


def _tok_s(rounds: list[dict[str, Any]]) -> float:
    return statistics.median(r["tokens"] / r["wall_s"] for r in rounds)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.targets import (
        MAX_MODEL_LEN,
        GatewayServer,
        _free_port,
        _Process,
        wait_http_healthy,
    )
    from client.text import load_tokenizer
    from gateway.tiny_model import TINY_MODEL_CONFIG, ensure_tiny_model, ensure_tiny_tokenizer

    model, tokenizer_dir = str(ensure_tiny_model()), str(ensure_tiny_tokenizer())
    tokenizer = load_tokenizer(tokenizer_dir)
    prompts = _prompts(args.requests, TINY_MODEL_CONFIG["vocab_size"])
    results: dict[str, Any] = {"gateway": {}, "http": []}
    server = GatewayServer(model)
    try:
        for _ in range(args.rounds + 1):  # the first round warms up and is dropped
            for level in sorted({args.concurrency, 256}):
                for mode in ("off", "on"):
                    got = await _gateway_round(
                        server.ipc, tokenizer, prompts, args.max_tokens, level, mode == "on"
                    )
                    results["gateway"].setdefault(f"{mode}@{level}", []).append(got)
    finally:
        server.stop()
    for key in results["gateway"]:
        results["gateway"][key] = results["gateway"][key][1:]
    port = _free_port()
    http = _Process(
        [
            sys.executable, "-m", "bench.vllm_cli", "serve", model, "--tokenizer", tokenizer_dir,
            "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--gpu-memory-utilization", "0.2", "--max-model-len", str(MAX_MODEL_LEN),
            "--disable-log-stats", "--uvicorn-log-level", "warning",
        ],
        "vllm-serve-text.log",
    )  # fmt: skip
    try:
        await wait_http_healthy(port, http)
        for _ in range(args.rounds + 1):
            results["http"].append(
                await _http_round(port, model, prompts, args.max_tokens, args.concurrency, http.pid)
            )
    finally:
        http.stop()
    results["http"] = results["http"][1:]
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    gateway, http = results["gateway"], results["http"]
    level = args.concurrency
    off, on = gateway[f"off@{level}"], gateway[f"on@{level}"]
    same = sum(on[-1]["texts"][i] == http[-1]["texts"][i] for i in range(len(http[-1]["texts"])))
    summary = {
        "client_us_per_token_text_off": _per_token_us(off),
        "client_us_per_token_text_on": _per_token_us(on),
        "http_frontend_us_per_token": _per_token_us(http),
        "tok_s_text_off_c256": _tok_s(gateway["off@256"]),
        "tok_s_text_on_c256": _tok_s(gateway["on@256"]),
        "tok_s_http": _tok_s(http),
        "same_text": f"{same}/{len(http[-1]['texts'])}",
    }
    s = summary
    text_cost = s["client_us_per_token_text_on"] - s["client_us_per_token_text_off"]
    ratio = s["client_us_per_token_text_on"] / s["http_frontend_us_per_token"]
    lines = [
        "# Text in the client: CPU per token and throughput",
        "",
        f"`python -m bench.text_cost --requests {args.requests} --concurrency {level} "
        f"--max-tokens {args.max_tokens} --rounds {args.rounds}`; tiny model, its byte-level "
        f"BPE; stop strings {STOPS!r} (never produced: every token detokenized and checked); "
        f"medians of {args.rounds} rounds after a warm-up.",
        "",
        "| measure | value |",
        "|---|---:|",
    ]
    on_off = s["tok_s_text_on_c256"] / s["tok_s_text_off_c256"]
    rows = [
        (f"client CPU per token, text off (c={level})",
         f"{s['client_us_per_token_text_off']:.1f} µs"),
        (f"client CPU per token, text on (c={level})",
         f"{s['client_us_per_token_text_on']:.1f} µs"),
        ("of which text (detokenization + stop strings)", f"{text_cost:.1f} µs"),
        (f"vLLM OpenAI server, frontend CPU per token, same text (c={level})",
         f"{s['http_frontend_us_per_token']:.1f} µs"),
        ("client with text on ÷ vLLM HTTP frontend", f"{ratio:.2f}"),
        ("gateway tok/s at c=256, text off", f"{s['tok_s_text_off_c256']:.0f}"),
        ("gateway tok/s at c=256, text on", f"{s['tok_s_text_on_c256']:.0f} ({on_off:.2f}x)"),
        (f"vLLM OpenAI server tok/s (c={level})", f"{s['tok_s_http']:.0f}"),
        ("requests whose text equals vLLM's", s["same_text"]),
    ]  # fmt: skip
    lines += [f"| {label} | {value} |" for label, value in rows]
    return "\n".join(lines) + "\n", summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "text_cost.md")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    text, summary = report(results, args)
    print(text)
    args.out.write_text(text)
    raw = {k: [{x: y for x, y in r.items() if x != "texts"} for r in v]
           for k, v in results["gateway"].items()}  # fmt: skip
    raw["http"] = [{x: y for x, y in r.items() if x != "texts"} for r in results["http"]]
    args.out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rounds": raw}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
