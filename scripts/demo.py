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
        await text_demo(client)


async def text_demo(client: AsyncClient) -> None:
    """Text next to the ids (client.text): the client detokenizes as vLLM's front-end does,
    ends a sample on a stop string (the gateway is told at once), and keeps a multi-turn
    conversation as the ids that were sampled."""
    from client.text import AsyncTextClient, Conversation, TextParams, load_tokenizer
    from gateway.tiny_model import ensure_tiny_tokenizer

    # A byte-level BPE of the model's 512 ids. Loading imports transformers (seconds): off
    # the event loop, so the client's heartbeats go on meanwhile.
    tokenizer = await asyncio.to_thread(load_tokenizer, ensure_tiny_tokenizer())
    text_client = AsyncTextClient(client, tokenizer)
    conversation = Conversation.start(tokenizer, [{"role": "user", "content": "Say café, 東京"}])
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    print(f"text: prompt {conversation.prompt_ids[:8]}... ({len(conversation.prompt_ids)} ids)")
    free = await text_client.complete(conversation.prompt_ids, greedy)
    pairs = [free.text[i : i + 2] for i in range(4, len(free.text) - 1)]
    stop = next((p for p in pairs if p.isprintable() and "\ufffd" not in p and p.strip()), "\n")
    print(f"  without stop strings: {free.text!r} ({len(free.token_ids)} ids)")
    sampled: list[int] = []
    async for out in text_client.generate(conversation.prompt_ids, greedy, TextParams(stop=[stop])):
        print(f"  ids {out.token_ids} -> text {out.text!r}")
        sampled += out.token_ids
        if out.done:
            print(f"  ended: {out.finish_reason.name}, stop string {out.stop_reason!r}")
    conversation.add_completion(sampled)
    added = conversation.add_messages([{"role": "user", "content": "Again?"}])
    print(
        f"  turn 2 prompt: {len(conversation.prompt_ids)} ids = turn 1 prompt + the "
        f"{len(sampled)} sampled ids + {len(added)} ids of the new message"
    )


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
