"""CPU cost of the KV-event feed per batch, and where it goes: receiving the frame, decoding
the batch, applying it to the index.

    python -m bench.probes.kv_feed_cost [--batches 3000] [--blocks 2] [--interval 0.002]

With ``--routing cache`` every engine step of every rank publishes a batch of KV events
(vLLM's ``EventBatch``: BlockStored of each block filled in the step, BlockRemoved of each
evicted); the gateway's ``KvEventFeed`` reads them on its event loop, beside everything
else it does. A PUB socket in another process sends BATCHES batches of BLOCKS
``BlockStored`` events (128-token blocks, as vLLM's CPU engine makes them), INTERVAL
seconds apart (0: back to back), to a ``KvEventFeed`` in this process, two ways, alternating
over ROUNDS: the feed as it is (drained on a 20 ms timer and before each routing decision:
no wake-up per batch), woken per batch by the loop's watch of its socket
(``LoopWatchedSocket``, how it read before), and woken per batch by pyzmq's asyncio receive
(how it read first). Reported: the receiving thread's CPU per batch, and decode and apply
alone (no socket) for the split.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from typing import Any

import msgspec
import zmq

from gateway.kv_event_feed import KvEventFeed
from gateway.loop_watched_socket import LoopWatchedSocket
from gateway.prefix_index import PrefixIndex, decode_batch

_BLOCK = 128


def _payloads(batches: int, blocks: int) -> list[bytes]:
    """vLLM-shaped batches: each block chained to the one before, as a decode step stores."""
    out = []
    parent = None
    for i in range(batches):
        events = []
        for j in range(blocks):
            block_hash = (i * blocks + j).to_bytes(32, "big")
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [block_hash],
                    "parent_block_hash": parent,
                    "token_ids": list(range(_BLOCK)),
                    "block_size": _BLOCK,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
            parent = block_hash
        out.append(msgspec.msgpack.encode([time.time(), events, 0]))
    return out


def _publisher(address: str, batches: int, blocks: int, interval: float, go: Any) -> None:
    payloads = _payloads(batches, blocks)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(address)
    go.wait()
    time.sleep(0.5)  # the subscriber's connection and subscription arrive
    next_at = time.monotonic()
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])
        if interval:
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    time.sleep(1.0)
    pub.close(linger=1000)
    ctx.term()


class _WokenPerBatchFeed(KvEventFeed):
    """The feed woken for each batch by the loop's watch of its socket (how it read until
    it was drained on a timer and before each decision)."""

    def start(self) -> None:
        super().start()
        assert self._task is not None
        self._task.cancel()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        sub = LoopWatchedSocket.adopt(self.sub, yield_when_waiting=False)
        while True:
            self._on_frames(await sub.recv_multipart())


class _PyzmqReceiveFeed(_WokenPerBatchFeed):
    """The feed with pyzmq's asyncio receive per frame (how it read first)."""

    async def _run(self) -> None:
        while True:
            self._on_frames(await self.sub.recv_multipart())


async def _one_round(feed_class: type, batches: int, blocks: int, interval: float) -> float:
    address = f"ipc://{tempfile.mkdtemp(prefix='eg-feed-')}/pub.sock"
    spawn = multiprocessing.get_context("spawn")
    go = spawn.Event()
    source = spawn.Process(target=_publisher, args=(address, batches, blocks, interval, go))
    source.start()
    index = PrefixIndex(1)
    feed = feed_class(index, [address], [None])
    feed.start()
    go.set()
    try:
        while feed.batches == 0:
            await asyncio.sleep(0.001)
        started = time.thread_time()
        first = feed.batches
        deadline = time.monotonic() + 60
        while feed.batches < batches and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        spent = time.thread_time() - started
        return spent / max(1, feed.batches - first) * 1e6
    finally:
        await feed.aclose()
        source.join(10)


def _decode_apply(batches: int, blocks: int) -> tuple[float, float]:
    payloads = _payloads(batches, blocks)
    started = time.thread_time()
    decoded = [decode_batch(p) for p in payloads]
    decode = (time.thread_time() - started) / batches * 1e6
    index = PrefixIndex(1)
    started = time.thread_time()
    for seq, batch in enumerate(decoded):
        index.apply(0, seq, batch)
    apply = (time.thread_time() - started) / batches * 1e6
    return decode, apply


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.kv_feed_cost", description=__doc__)
    p.add_argument("--batches", type=int, default=3000)
    p.add_argument("--blocks", type=int, default=2, help="BlockStored events per batch")
    p.add_argument("--interval", type=float, default=0.002, help="seconds between batches")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here too")
    args = p.parse_args(argv)
    import uvloop

    ways = {
        "drained every 20 ms (now)": KvEventFeed,
        "woken per batch, loop-watched socket (before)": _WokenPerBatchFeed,
        "woken per batch, pyzmq receive (first)": _PyzmqReceiveFeed,
    }
    results: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, feed_class in ways.items():
            cost = uvloop.run(_one_round(feed_class, args.batches, args.blocks, args.interval))
            results[name].append(cost)
    decode, apply = _decode_apply(args.batches, args.blocks)
    print(
        f"{args.batches} batches of {args.blocks} BlockStored, {args.interval * 1000:g} ms apart;"
        " the feed thread's CPU per batch (µs), per round:"
    )
    for name, costs in results.items():
        shown = " / ".join(f"{c:.1f}" for c in costs)
        print(f"  {name}: {shown} (median {statistics.median(costs):.1f})")
    print(f"  of which decode {decode:.1f} and apply {apply:.1f} (no socket)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**vars(args), "results": results, "decode": decode, "apply": apply}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
