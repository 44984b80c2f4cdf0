"""What a leaner engine-core client could save: decoding one engine step, and the hop.

    python -m bench.probes.engine_decode [--outputs 120] [--out bench/results/engine_decode.json]

The gateway reads vLLM's engine-core outputs through vLLM's AsyncMPClient: its output
task receives each step's frame, decodes it with vLLM's ``MsgpackDecoder`` into
``EngineCoreOutputs`` and hands it over through an ``asyncio.Queue``. A leaner client
would decode only the fields the gateway uses and skip the task hop. This measures both
savings in isolation (warm caches: an upper bound on what the gateway's profile shows):

- ``vllm_decode``: vLLM's decoder on a step of N one-token outputs, as the engine core
  encodes it (vLLM's ``MsgpackEncoder``);
- ``lean_decode``: msgspec into a struct of only ``request_id`` and ``new_token_ids``
  (array-like structs ignore trailing fields, so it reads the same frame);
- ``queue_hop``: one step through a producer task, ``asyncio.Queue`` and a consumer
  task on uvloop, less a direct call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import msgspec


class LeanOutput(msgspec.Struct, array_like=True, gc=False):
    """The leading fields of vLLM's EngineCoreOutput that a plain token step carries."""

    request_id: str
    new_token_ids: list[int]


class LeanOutputs(msgspec.Struct, array_like=True, gc=False):
    """The leading fields of vLLM's EngineCoreOutputs."""

    engine_index: int = 0
    outputs: list[LeanOutput] = []


def engine_step_frames(outputs: int) -> list:
    """One engine step of ``outputs`` one-token outputs, encoded as the engine core does."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackEncoder

    step = EngineCoreOutputs(
        engine_index=0,
        outputs=[
            EngineCoreOutput(request_id=f"g0.{i}-{i:08x}", new_token_ids=[1000 + i])
            for i in range(outputs)
        ],
    )
    return MsgpackEncoder().encode(step)


def per_call_us(fn, seconds: float = 1.0) -> float:  # noqa: ANN001
    """Median over 5 timed batches of ``fn()``, in µs per call."""
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds / 10:
        fn()
        calls += 1
    batch = max(calls, 1)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - start) / batch * 1e6)
    return sorted(samples)[2]


async def queue_hop_us(steps: int = 20_000) -> float:
    """µs per item through producer task -> asyncio.Queue -> consumer, less a direct call."""
    queue: asyncio.Queue = asyncio.Queue()
    sink: list = []

    async def producer() -> None:
        for i in range(steps):
            queue.put_nowait(i)
            await asyncio.sleep(0)  # as the output task does between socket reads
        queue.put_nowait(None)

    async def consumer() -> None:
        while (item := await queue.get()) is not None:
            sink.append(item)

    start = time.perf_counter()
    await asyncio.gather(producer(), consumer())
    hop = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(steps):
        sink.append(i)
        await asyncio.sleep(0)
    direct = time.perf_counter() - start
    return (hop - direct) / steps * 1e6


def measure(outputs: int) -> dict:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    frames = engine_step_frames(outputs)
    vllm_decoder = MsgpackDecoder(EngineCoreOutputs)
    lean_decoder = msgspec.msgpack.Decoder(LeanOutputs)
    full, lean = vllm_decoder.decode(frames), lean_decoder.decode(frames[0])
    assert [o.request_id for o in full.outputs] == [o.request_id for o in lean.outputs]
    assert [o.new_token_ids for o in full.outputs] == [o.new_token_ids for o in lean.outputs]
    vllm_us = per_call_us(lambda: vllm_decoder.decode(frames))
    lean_us = per_call_us(lambda: lean_decoder.decode(frames[0]))
    import uvloop

    hop_us = uvloop.run(queue_hop_us())
    return {
        "outputs_per_step": outputs,
        "frame_bytes": sum(len(memoryview(f)) for f in frames),
        "vllm_decode_us_per_step": round(vllm_us, 1),
        "lean_decode_us_per_step": round(lean_us, 1),
        "decode_saving_us_per_output": round((vllm_us - lean_us) / outputs, 3),
        "queue_hop_us_per_step": round(hop_us, 1),
        "hop_saving_us_per_output": round(hop_us / outputs, 3),
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.engine_decode", description=__doc__)
    p.add_argument("--outputs", type=int, default=120, help="outputs per engine step")
    p.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    args = p.parse_args(argv)
    result = measure(args.outputs)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
