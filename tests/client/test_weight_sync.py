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


def test_buckets_fill_the_arenas_halves_in_turn_and_a_larger_tensor_goes_to_a_file(tmp_path):
    from gateway.weight_buffers import WeightArena

    arena = WeightArena(1 << 12)  # halves of 2048 bytes
    try:
        path = arena.make()
        tensors = [
            ("a", torch.full((256,), 1.0)),  # 1 KiB
            ("b", torch.full((256,), 2.0)),
            ("big", torch.full((1024,), 3.0)),  # 4 KiB: more than half the arena
            ("c", torch.full((256,), 4.0)),
        ]
        with shared_memory_buckets(
            tensors, directory=str(tmp_path), bucket_bytes=1 << 10, arena=(path, 1 << 12)
        ) as buckets:
            infos = []
            for info in buckets:
                infos.append(info)
                data = torch.frombuffer(bytearray(_read(info["buffer"])), dtype=torch.float32)
                start = info["offsets"][0] // 4
                name = info["names"][0]
                want = dict(tensors)[name]
                assert data[start : start + want.numel()].tolist() == want.tolist(), name
        assert [i["names"] for i in infos] == [["a"], ["b"], ["big"], ["c"]]
        assert [i["buffer"] == path for i in infos] == [True, True, False, True]
        assert [i["offsets"][0] for i in infos if i["buffer"] == path] == [0, 2048, 0]
        assert os.listdir(tmp_path) == []  # the file bucket is gone
    finally:
        arena.close()


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read(8192)


def test_a_trainer_that_cannot_open_the_arena_writes_files(tmp_path):
    with shared_memory_buckets(
        _tensors(2), directory=str(tmp_path), bucket_bytes=1, arena=("/no/such/arena", 4096)
    ) as buckets:
        assert all(info["buffer"].startswith(str(tmp_path)) for info in buckets)


def test_a_trainer_updating_two_gateways_at_once_keeps_writing_to_each(tmp_path):
    """The kept mapping is one arena's; opening a second gateway's arena (a trainer that
    updates two rollout engines at once) must not close the first under its update."""
    from gateway.weight_buffers import WeightArena

    first, second = WeightArena(1 << 12), WeightArena(1 << 12)
    try:
        paths = first.make(), second.make()
        with shared_memory_buckets(
            _tensors(3), directory=str(tmp_path), bucket_bytes=1, arena=(paths[0], 1 << 12)
        ) as to_first:
            assert next(to_first)["buffer"] == paths[0]
            with shared_memory_buckets(
                _tensors(1), directory=str(tmp_path), bucket_bytes=1, arena=(paths[1], 1 << 12)
            ) as to_second:
                assert next(to_second)["buffer"] == paths[1]
            infos = list(to_first)
        assert [i["buffer"] for i in infos] == [paths[0], paths[0]]
        data = torch.frombuffer(bytearray(_read(paths[0])), dtype=torch.float32)
        start = infos[-1]["offsets"][0] // 4
        assert data[start : start + 4].tolist() == [2.0] * 4  # t2 landed in the first arena
    finally:
        first.close()
        second.close()
