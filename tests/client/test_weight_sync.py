"""The trainer's bucket writer, without a gateway: buckets written one ahead, each removed
once the next is asked for, and a close from another thread (a cancelled asend_weights)
waits for a bucket being made instead of failing, and leaves no file behind."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from client.weight_sync import _Buckets, shared_memory_buckets  # noqa: E402


def _tensors(count: int):
    return [(f"t{i}", torch.full((4,), float(i))) for i in range(count)]


def test_buckets_are_written_ahead_and_removed_once_passed(tmp_path):
    with shared_memory_buckets(_tensors(3), directory=str(tmp_path), bucket_bytes=1) as buckets:
        first = next(buckets)
        assert first["names"] == ["t0"] and os.path.exists(first["buffer"])
        raw = bytearray(Path(first["buffer"]).read_bytes())
        data = torch.frombuffer(raw, dtype=torch.float32)
        assert data[:4].tolist() == [0.0] * 4
        second = next(buckets)
        assert not os.path.exists(first["buffer"]) and os.path.exists(second["buffer"])
    assert os.listdir(tmp_path) == []


def test_a_close_while_the_next_bucket_is_being_made_waits_and_cleans_up(tmp_path):
    making = threading.Event()

    def slow():
        yield "a", torch.zeros(4)
        making.set()
        time.sleep(0.5)
        yield "b", torch.ones(4)

    async def cancelled() -> None:
        buckets = _Buckets(slow(), 1, str(tmp_path))
        pending = asyncio.ensure_future(asyncio.to_thread(next, buckets, None))
        while not making.is_set():
            await asyncio.sleep(0.01)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await asyncio.to_thread(buckets.close)  # was: "generator already executing"
        assert next(buckets, None) is None  # closed: nothing more

    asyncio.run(cancelled())
    assert os.listdir(tmp_path) == []
