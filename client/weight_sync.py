"""The trainer's side of in-memory weight updates (PROTOCOL.md §7.14). Needs torch:
``pip install 'engine-gateway[trainer]'``; the rest of the client does not.

- ``send_weights(client, named_tensors, version=...)`` (blocking ``Client``) and
  ``await asend_weights(async_client, ...)``: a trainer holding a state dict updates the
  gateway's engines through the ``cpu`` backend (engines started with
  ``--weight-transfer-config '{"backend": "cpu"}'`` on this host): pause, start, transfer
  in shared-memory buckets, finish with the version, resume.
- ``GatewayWeightSyncClient(client)``: vLLM's ``VLLMWeightSyncClient`` protocol over a
  gateway, for vLLM's own trainer engines (``nccl``, ``ipc``, and the ``cpu`` one in
  ``client.vllm_trainer``): ``WeightTransferTrainerFactory.trainer_init(init_info,
  client=GatewayWeightSyncClient(gw), source=...)`` then ``send_weights()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from codec import ControlDone

from .aio import AsyncClient
from .sync import Client

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECTORY",
    "GatewayWeightSyncClient",
    "asend_weights",
    "send_weights",
    "shared_memory_buckets",
]

DEFAULT_DIRECTORY = "/dev/shm"
DEFAULT_BUCKET_BYTES = 512 << 20
_ALIGN = 64  # every tensor starts at a multiple of this (any element size divides it)
_PAUSE_MODES = ("keep", "wait", "abort", "none")


class GatewayWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` (four plain methods, plus shutdown) over a blocking
    ``Client``: vLLM's trainer engines drive a gateway's engines through it unchanged.
    Errors are the client's ``RequestFailed`` with the gateway's code."""

    def __init__(self, client: Client):
        self.client = client

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.client.shutdown_weight_transfer_engine()


@contextlib.contextmanager
def shared_memory_buckets(
    named_tensors: Iterable[tuple[str, Any]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    directory: str = DEFAULT_DIRECTORY,
) -> Iterator[Iterator[dict[str, Any]]]:
    """The ``cpu`` backend's ``update_info`` maps for ``named_tensors``, one per bucket of
    at most ``bucket_bytes`` (a larger tensor gets a bucket of its own). Each bucket is a
    file in ``directory`` (tmpfs: memory); the next one is written on a thread while the
    caller sends this one, and each is removed once the next is asked for, or on exit (the
    engine's workers keep their mappings until the update ends). Tensors are read from
    wherever they live (moved to CPU)."""
    written: list[str] = []  # files not removed yet

    def remove(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with contextlib.suppress(ValueError):
            written.remove(path)

    def buckets() -> Iterator[dict[str, Any]]:
        with ThreadPoolExecutor(1, thread_name_prefix="weight-buckets") as writer:
            pending = None
            for group, size in _groups(named_tensors, bucket_bytes):
                future = writer.submit(_write_bucket, group, size, directory, written)
                if pending is not None:
                    info = pending.result()
                    yield info
                    remove(info["buffer"])
                pending = future
            if pending is not None:
                info = pending.result()
                yield info
                remove(info["buffer"])

    stream = buckets()
    try:
        yield stream
    finally:
        stream.close()  # waits for a bucket being written
        for path in list(written):
            remove(path)


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
    directory: str = DEFAULT_DIRECTORY,
) -> ControlDone:
    """Update the gateway's engines with ``named_tensors`` (checkpoint names, e.g. a
    ``state_dict().items()``) through the ``cpu`` backend; FinishWeightUpdate's reply.

    ``pause``: "keep" (running requests freeze and go on under the new weights: two
    version spans), "wait" (they finish first), "abort" (they end), or "none" (no Pause
    call; the gateway still holds generation while the update is open). A failure raises
    ``RequestFailed`` (INVALID_REQUEST: nothing changed; WEIGHTS_INCOMPLETE: some layers
    took new weights and generation is refused until a complete update)."""
    _check_pause(pause)
    client.init_weight_transfer_engine({"directory": directory})
    if pause != "none":
        client.pause(pause)
    try:
        client.start_weight_update()
        with shared_memory_buckets(
            named_tensors, bucket_bytes=bucket_bytes, directory=directory
        ) as buckets:
            for update_info in buckets:
                client.update_weights(update_info)
        return client.finish_weight_update(version)
    finally:
        if pause != "none":
            client.resume()


async def asend_weights(
    client: AsyncClient,
    named_tensors: Iterable[tuple[str, Any]],
    *,
    version: str | None = None,
    pause: str = "keep",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    directory: str = DEFAULT_DIRECTORY,
) -> ControlDone:
    """``send_weights`` for an ``AsyncClient``; bucket files are written off the event loop
    (its heartbeats go on meanwhile)."""
    _check_pause(pause)
    await client.init_weight_transfer_engine({"directory": directory})
    if pause != "none":
        await client.pause(pause)
    try:
        await client.start_weight_update()
        with shared_memory_buckets(
            named_tensors, bucket_bytes=bucket_bytes, directory=directory
        ) as buckets:
            while (update_info := await asyncio.to_thread(next, buckets, None)) is not None:
                await client.update_weights(update_info)
        return await client.finish_weight_update(version)
    finally:
        if pause != "none":
            await client.resume()


def _check_pause(pause: str) -> None:
    if pause not in _PAUSE_MODES:
        raise ValueError(f"pause must be one of {_PAUSE_MODES}, got {pause!r}")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _write_bucket(
    bucket: list[tuple[str, Any]], size: int, directory: str, files: list[str]
) -> dict[str, Any]:
    """Write ``bucket``'s tensors into a new file in ``directory``; its ``update_info``."""
    import torch

    fd, path = tempfile.mkstemp(prefix="engine-gateway-weights-", dir=directory)
    files.append(path)
    names, dtype_names, shapes, offsets = [], [], [], []
    try:
        os.ftruncate(fd, max(size, 1))
        with mmap.mmap(fd, max(size, 1)) as mapping:
            raw = torch.frombuffer(mapping, dtype=torch.uint8)
            offset = 0
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
            del raw
    finally:
        os.close(fd)
    return {
        "buffer": path,
        "names": names,
        "dtype_names": dtype_names,
        "shapes": shapes,
        "offsets": offsets,
    }
