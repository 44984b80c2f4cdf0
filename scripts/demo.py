"""Demo: start `engine-gateway serve` on the tiny model, stream, abort, measure, stop.

Run by `make demo`. Starts the gateway as a subprocess (the real CLI path),
streams several concurrent requests from one client, aborts one mid-stream,
prints tokens and throughput, then drains the gateway with SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

from client import AsyncClient, FinishReason, SamplingParams


async def stream_one(
    client: AsyncClient,
    name: str,
    prompt: list[int],
    max_tokens: int,
    abort_after: int | None = None,
) -> tuple[str, list[int], str]:
    tokens: list[int] = []
    reason = "?"
    async for out in client.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        request_id=name,
    ):
        tokens.extend(out.new_token_ids)
        if out.finished is not None:
            reason = out.finished.finish_reason.name
        if abort_after is not None and len(tokens) >= abort_after and out.finished is None:
            ack = await client.abort([out.request_id])
            print(f"  [{name}] aborted after {len(tokens)} tokens: {ack}")
            abort_after = None
    return name, tokens, reason


async def run_demo(address: str) -> None:
    async with AsyncClient(address, name="demo", connect_timeout_s=300) as client:
        ack = client.hello_ack
        print(
            f"connected: model={ack.model.name} max_model_len={ack.model.max_model_len} "
            f"vocab={ack.model.vocab_size} eos={ack.model.eos_token_ids} "
            f"cpu_attention={ack.model.cpu_attention}"
        )
        print(f"ping: {await client.ping() * 1e6:.0f} us")
        prompts = [[1, 17, 42, 99 + i] for i in range(8)]
        start = time.perf_counter()
        jobs = [
            stream_one(client, f"req{i}", p, 64, abort_after=8 if i == 3 else None)
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*jobs)
        elapsed = time.perf_counter() - start
        total = 0
        for name, tokens, reason in results:
            total += len(tokens)
            print(f"  [{name}] {reason:6} {len(tokens):3} tokens: {tokens[:12]}...")
        print(
            f"{len(results)} concurrent streams, {total} tokens in {elapsed:.2f}s "
            f"= {total / elapsed:.0f} tokens/s"
        )
        done = await client.complete([1, 17, 42], SamplingParams(temperature=0.0, max_tokens=16))
        assert done.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        print(f"non-streaming: {done.token_ids} ({done.finish_reason.name})")


def main() -> int:
    workdir = tempfile.mkdtemp(prefix="engine-gateway-demo-")
    address = f"ipc://{workdir}/gateway.sock"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log_path = os.path.join(workdir, "gateway.log")
    print(f"starting gateway on {address} (log: {log_path}); first start takes ~1 minute")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--bind", address],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        asyncio.run(run_demo(address))
    except BaseException:
        with open(log_path) as log_file:
            print(log_file.read()[-4000:], file=sys.stderr)
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        print(f"gateway stopped (exit {code})")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
