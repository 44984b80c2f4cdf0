"""The trainer's side of in-memory weight updates (PROTOCOL.md §7.14). Needs torch:
``pip install 'engine-gateway[trainer]'``; the rest of the client does not.

- ``send_weights(client, named_tensors, version=...)`` (blocking ``Client``) and
  ``await asend_weights(async_client, ...)``: a trainer holding a state dict updates the
  gateway's engines through the ``cpu`` backend (engines started with
  ``--weight-transfer-config '{"backend": "cpu"}'`` on this host): init (the gateway answers
  with its private buffer folder), start (the gateway holds generation with the pause mode
  asked for, until the update ends), shared-memory buckets, finish with the version. Any
  failure, timeout or cancellation on the way abandons the update, so the engine never
  stays held, and the original error is raised.
- ``GatewayWeightSyncClient(client)``: vLLM's ``VLLMWeightSyncClient`` protocol over a
  gateway, for trainer engines of vLLM's interface (the ``cpu`` one in
  ``client.vllm_trainer``; the gateway refuses vLLM's ``nccl`` TCPStore rendezvous and its
  ``ipc`` backend: PROTOCOL.md §7.14):
  ``WeightTransferTrainerFactory.trainer_init(init_info, client=GatewayWeightSyncClient(gw),
  source=...)`` then ``send_weights()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from codec import ControlDone

from .aio import AsyncClient
from .sync import Client

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GatewayWeightSyncClient",
    "IncompleteWeightUpdate",
    "asend_weights",
    "buffer_arena",
    "buffer_folder",
    "send_weights",
    "shared_memory_buckets",
]

DEFAULT_BUCKET_BYTES = 512 << 20
_ALIGN = 64  # every tensor starts at a multiple of this (any element size divides it)
_PAUSE_MODES = ("keep", "wait", "abort", "none")
_ABANDON_TIMEOUT_S = 30.0  # an abandon after a failure waits this long at most


class IncompleteWeightUpdate(RuntimeError):
    """A finished update left some layers with their old weights (``result`` says which)."""

    def __init__(self, result: dict[str, Any]):
        super().__init__(
            f"the weight update gave new weights to {result.get('layers_updated')} of"
            f" {result.get('layers')} layers; kept: {result.get('layers_not_updated')}"
        )
        self.result = result


def buffer_arena(init_reply: ControlDone) -> tuple[str, int] | None:
    """The gateway's shared-memory arena for the ``cpu`` backend (InitWeightTransfer's
    reply): its path and size, or None where the gateway has none (``--weight-arena-mb
    0``, or an older gateway)."""
    result = init_reply.result
    if not isinstance(result, dict):
        return None
    path, size = result.get("arena"), result.get("arena_bytes")
    if isinstance(path, str) and path and isinstance(size, int) and size > 0:
        return path, size
    return None


def buffer_folder(init_reply: ControlDone) -> str:
    """The folder the gateway made for the ``cpu`` backend's buffers (InitWeightTransfer's
    reply); ValueError for a gateway that named none (another backend)."""
    result = init_reply.result
    if not isinstance(result, dict) or not isinstance(result.get("directory"), str):
        raise ValueError(
            "the gateway named no buffer folder: are its engines started with"
            """ --weight-transfer-config '{"backend": "cpu"}'?"""
        )
    return result["directory"]


class GatewayWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (four plain methods, plus shutdown) over a blocking
    ``Client``: vLLM's trainer engines drive a gateway's engines through it unchanged.
    Errors are the client's ``RequestFailed`` with the gateway's code."""

    def __init__(self, client: Client, *, require_complete: bool = True):
        self.client = client
        self.require_complete = require_complete
        self.directory: str | None = None  # the cpu backend's buffer folder, after init
        self.arena: tuple[str, int] | None = None  # and its shared-memory arena, if any
        self.last_result: dict[str, Any] | None = None  # the latest finish's result

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        reply = self.client.init_weight_transfer_engine(init_info)
        with contextlib.suppress(ValueError):  # another backend names no folder
            self.directory = buffer_folder(reply)
        self.arena = buffer_arena(reply)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Finish; with ``require_complete`` (the default), an update that left any layer
        with its old weights raises ``IncompleteWeightUpdate`` (vLLM's trainer path sends
        whole models, and its protocol returns nothing)."""
        result = self.client.finish_weight_update(weight_version).result
        self.last_result = result
        if (
            self.require_complete
            and isinstance(result, dict)
            and result.get("layers_updated", 0) < result.get("layers", 0)
        ):
            raise IncompleteWeightUpdate(result)

    def abandon_weight_update(self) -> None:
        """End the open update where it stands (beyond vLLM's protocol: a trainer that
        fails part-way calls it so that the engine is not held until the stall timeout)."""
        self.client.abandon_weight_update()

    def shutdown_weight_transfer_engine(self) -> None:
        self.client.shutdown_weight_transfer_engine()


@contextlib.contextmanager
def shared_memory_buckets(
    named_tensors: Iterable[tuple[str, Any]],
    *,
    directory: str,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    arena: tuple[str, int] | None = None,
) -> Iterator[Iterator[dict[str, Any]]]:
    """The ``cpu`` backend's ``update_info`` maps for ``named_tensors``, one per bucket of
    at most ``bucket_bytes`` (a larger tensor gets a bucket of its own). The next bucket
    is written on a thread while the caller sends this one.

    With ``arena`` (the gateway's shared-memory arena: ``buffer_arena``), buckets fill its
    two halves in turn, in place (at most half of it each): no file, no fresh page. A
    bucket goes into a file in ``directory`` (the gateway's buffer folder:
    ``buffer_folder``) where there is no arena, where this process cannot open it (another
    user or PID namespace), or for a tensor larger than half of it; a file is removed once
    the next bucket is asked for, or on exit (the workers have loaded or copied what a
    chunk names before answering it). Tensors are read from wherever they live (moved to
    CPU). The iterator may be advanced from another thread; leaving the block waits for a
    bucket being written."""
    buckets = _Buckets(named_tensors, bucket_bytes, directory, arena)
    try:
        yield buckets
    finally:
        buckets.close()


class _Buckets:
    """Buckets written one ahead on a thread; safe to advance from any one thread at a
    time and to close from another (close waits for an advance under way)."""

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        bucket_bytes: int,
        directory: str,
        arena: tuple[str, int] | None = None,
    ):
        self._arena = _ArenaWriter.open(*arena) if arena is not None else None
        if self._arena is not None:
            bucket_bytes = min(bucket_bytes, self._arena.half)
        self._groups = _groups(named_tensors, bucket_bytes)
        self._directory = directory
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="weight-buckets")
        self._lock = threading.Lock()
        self._pending: Future | None = None
        self._sent: str | None = None  # the bucket handed out last
        self._written: list[str] = []  # files not removed yet
        self._closed = False
        self.write_seconds = 0.0  # spent copying tensors in (for benchmarks)

    def __iter__(self) -> _Buckets:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._lock:
            if self._closed:
                raise StopIteration
            if self._sent is not None:
                self._remove(self._sent)
                self._sent = None
            if self._pending is None:
                self._pending = self._write_next()
            if self._pending is None:
                raise StopIteration
            info = self._pending.result()
            self._pending = self._write_next()  # written while this one is sent
            if self._arena is None or info["buffer"] != self._arena.path:
                self._sent = info["buffer"]
            return info

    def _write_next(self) -> Future | None:
        group = next(self._groups, None)
        if group is None:
            return None
        tensors, size = group
        return self._writer.submit(self._timed_write, tensors, size)

    def _timed_write(self, tensors: list[tuple[str, Any]], size: int) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            if self._arena is not None and size <= self._arena.half:
                # The half the bucket before last used: that chunk has been answered.
                return self._arena.write(tensors)
            return _write_bucket(tensors, size, self._directory, self._written)
        finally:
            self.write_seconds += time.perf_counter() - started

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with contextlib.suppress(ValueError):
            self._written.remove(path)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._writer.shutdown(wait=True)  # a bucket being written ends first
            for path in list(self._written):
                self._remove(path)


class _ArenaWriter:
    """The trainer's use of the gateway's arena: buckets go into its halves in turn."""

    def __init__(self, path: str, mapping: mmap.mmap, size: int):
        self.path = path
        self.half = size // 2 // _ALIGN * _ALIGN
        self._mapping = mapping
        self._next_half = 0

    @classmethod
    def open(cls, path: str, size: int) -> _ArenaWriter | None:
        """The arena at ``path`` mapped shared; None where this process cannot open it."""
        mapping = _mapped_arena(path, size)
        return None if mapping is None else cls(path, mapping, size)

    def write(self, bucket: list[tuple[str, Any]]) -> dict[str, Any]:
        """Copy ``bucket``'s tensors into the next half; its ``update_info``."""
        base = self._next_half * self.half
        self._next_half ^= 1
        info = _copy_into(self._mapping, base, bucket)
        info["buffer"] = self.path
        return info


_arena_mapping: tuple[tuple[int, int, int], mmap.mmap] | None = None
_arena_lock = threading.Lock()


def _mapped_arena(path: str, size: int) -> mmap.mmap | None:
    """This process's mapping of the arena at ``path``, kept from one update to the next
    (its page tables filled once: each update writes the same pages). Another arena (a
    restarted gateway, or a second gateway this trainer also updates) takes the cache's
    place; the mapping it replaces is not closed here, as an update to that gateway may
    still be writing through it: it is unmapped once nothing holds it. None where this
    process cannot open the arena (another user or PID namespace)."""
    global _arena_mapping
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        found = os.fstat(fd)
        if found.st_size != size:
            return None
        key = (found.st_dev, found.st_ino, size)
        with _arena_lock:
            if _arena_mapping is not None and _arena_mapping[0] == key:
                return _arena_mapping[1]
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            _arena_mapping = (key, mapping)
            return mapping
    except OSError:
        return None
    finally:
        os.close(fd)


def _groups(
    named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, Any]], int]]:
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, size
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, size


def send_weights(
    client: Client,
    named_tensors: Iterable[tuple[str, Any]],
    *,
    version: str | None = None,
    pause: str = "keep",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ControlDone:
    """Update the gateway's engines with ``named_tensors`` (checkpoint names, e.g. a
    ``state_dict().items()``) through the ``cpu`` backend; FinishWeightUpdate's reply.

    ``pause``: how the gateway holds generation for the update (the hold ends with it,
    however it ends): "keep" (running requests freeze and go on under the new weights: two
    version spans), "wait" (they finish first), "abort" (they end); "none" is "keep". A
    failure raises ``RequestFailed`` (INVALID_REQUEST: nothing changed; WEIGHTS_INCOMPLETE:
    some layers took new weights and generation is refused until a complete update); that,
    a timeout or Ctrl-C first abandons the update (AbandonWeightUpdate)."""
    _check_pause(pause)
    init = client.init_weight_transfer_engine({})
    directory, arena = buffer_folder(init), buffer_arena(init)
    client.start_weight_update(None if pause == "none" else pause)
    try:
        with shared_memory_buckets(
            named_tensors, bucket_bytes=bucket_bytes, directory=directory, arena=arena
        ) as buckets:
            for update_info in buckets:
                client.update_weights(update_info)
        return client.finish_weight_update(version)
    except BaseException:
        with contextlib.suppress(Exception):
            client.abandon_weight_update()  # refused if the gateway ended it already
        raise


async def asend_weights(
    client: AsyncClient,
    named_tensors: Iterable[tuple[str, Any]],
    *,
    version: str | None = None,
    pause: str = "keep",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> ControlDone:
    """``send_weights`` for an ``AsyncClient``; bucket files are written off the event loop
    (its heartbeats go on meanwhile). Cancelling it abandons the update and raises
    CancelledError."""
    _check_pause(pause)
    init = await client.init_weight_transfer_engine({})
    directory, arena = buffer_folder(init), buffer_arena(init)
    await client.start_weight_update(None if pause == "none" else pause)
    buckets = await asyncio.to_thread(_Buckets, named_tensors, bucket_bytes, directory, arena)
    try:
        while (update_info := await asyncio.to_thread(next, buckets, None)) is not None:
            await client.update_weights(update_info)
        return await client.finish_weight_update(version)
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.abandon_weight_update(), _ABANDON_TIMEOUT_S)
        raise
    finally:
        await asyncio.to_thread(buckets.close)  # a bucket being written ends first


def _check_pause(pause: str) -> None:
    if pause not in _PAUSE_MODES:
        raise ValueError(f"pause must be one of {_PAUSE_MODES}, got {pause!r}")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _write_bucket(
    bucket: list[tuple[str, Any]], size: int, directory: str, files: list[str]
) -> dict[str, Any]:
    """Write ``bucket``'s tensors into a new file in ``directory``; its ``update_info``."""
    fd, path = tempfile.mkstemp(prefix="bucket-", dir=directory)
    files.append(path)
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as mapping:
            info = _copy_into(mapping, 0, bucket)
    finally:
        os.close(fd)
    info["buffer"] = path
    return info


def _copy_into(mapping: mmap.mmap, base: int, bucket: list[tuple[str, Any]]) -> dict[str, Any]:
    """Copy ``bucket``'s tensors into ``mapping`` from byte ``base`` on, each aligned; the
    ``update_info`` naming them (without ``buffer``)."""
    import torch

    names, dtype_names, shapes, offsets = [], [], [], []
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    try:
        offset = base
        for name, tensor in bucket:
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            nbytes = data.numel() * data.element_size()
            if nbytes:
                raw[offset : offset + nbytes].copy_(data.view(torch.uint8))
            names.append(name)
            dtype_names.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
            offsets.append(offset)
            offset += _aligned(nbytes)
    finally:
        del raw
    return {"names": names, "dtype_names": dtype_names, "shapes": shapes, "offsets": offsets}
