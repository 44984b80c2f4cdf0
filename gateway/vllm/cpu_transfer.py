"""The ``cpu`` weight-transfer backend (registered by the plugin): a trainer on the engine's
host writes tensors into files in a folder the gateway made for it; each worker copies the
tensors a chunk names out of the file before the chunk is answered, and loads the copies
through vLLM's layerwise reload.

Wire maps (PROTOCOL.md §7.14): ``init_info`` ``{"directory": str}``, set by the gateway
(never by a client): a folder it created for this trainer, private (mode 0700) and owned by
the engine's user. ``update_info`` ``{"buffer": path, "names": [str], "dtype_names": [str],
"shapes": [[int]], "offsets": [int]}``: tensor i is ``shapes[i]`` elements of
``dtype_names[i]`` (torch names), little-endian, C order, at byte ``offsets[i]`` of the
file (aligned to the element size). The file must be a regular file directly in that
folder, owned by the engine's user, with one link; it is opened without following links,
relative to the folder opened at init, and checked on the open descriptor (no path is
looked at twice). Nothing of it is kept once the chunk is answered: the trainer may delete,
truncate or rewrite it then.

The arena (``init_info`` ``"arena": path, "arena_bytes": size``, also set by the gateway
only): a sealed memfd of that size (``gateway.weight_buffers.WeightArena``), mapped once at
init. A chunk whose ``buffer`` is the arena's path names byte ranges of it; its tensors
load as views of the mapping (no copy, no page fault), and before the chunk is answered
the tensors a layer still waits with (its other tensors are in a later chunk) are copied
out, so the trainer may then rewrite any of it. The seals keep its size fixed, so no
reader meets a truncated mapping. Either way, a layer whose tensors all arrived is built
in its old tensors' memory (``layerwise.building_in_place``). Runs in vLLM's worker
processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import stat
import warnings
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .layerwise import building_in_place
from .weight_updates import REFUSED

__all__ = ["CpuInitInfo", "CpuUpdateInfo", "CpuWeightTransferEngine", "check_private_folder"]


@dataclass
class CpuInitInfo(WeightTransferInitInfo):
    directory: str = ""
    arena: str = ""
    arena_bytes: int = 0


@dataclass
class CpuUpdateInfo(WeightTransferUpdateInfo):
    buffer: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        count = len(self.names)
        for label in ("dtype_names", "shapes", "offsets"):
            if len(getattr(self, label)) != count:
                raise ValueError(
                    f"{REFUSED}: update_info.{label} has {len(getattr(self, label))} entries"
                    f" for {count} names"
                )


class CpuWeightTransferEngine(WeightTransferEngine[CpuInitInfo, CpuUpdateInfo]):
    """Worker side of the ``cpu`` backend."""

    init_info_cls = CpuInitInfo
    update_info_cls = CpuUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.directory = ""
        self._folder_fd: int | None = None  # the folder, opened once at init
        self._arena: _MappedArena | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> CpuInitInfo:
        try:
            return CpuInitInfo(**init_dict)
        except TypeError as exc:
            raise ValueError(f"{REFUSED}: init_info for the cpu backend: {exc}") from None

    def parse_update_info(self, update_dict: dict[str, Any]) -> CpuUpdateInfo:
        if not isinstance(update_dict, dict):
            raise ValueError(f"{REFUSED}: update_info must be a map, got {update_dict!r:.80}")
        try:
            return CpuUpdateInfo(**update_dict)
        except TypeError as exc:
            raise ValueError(f"{REFUSED}: update_info for the cpu backend: {exc}") from None

    def init_transfer_engine(self, init_info: CpuInitInfo) -> None:
        folder_fd = check_private_folder(init_info.directory)
        try:
            arena = (
                _MappedArena.open(init_info.arena, init_info.arena_bytes, self._arena)
                if init_info.arena
                else None
            )
        except BaseException:
            os.close(folder_fd)
            raise
        if self._arena is not arena:  # not the same arena kept
            self._close_arena()
        self._close_folder()
        self.directory, self._folder_fd, self._arena = init_info.directory, folder_fd, arena

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with building_in_place():
            finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which CPU-only torch
        # lacks; loading from copies is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CpuUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        checked = self._check(update_info)
        arena = self._arena
        if arena is not None and update_info.buffer != arena.path:
            arena = None  # a buffer file
        tensors = arena.views(checked) if arena is not None else self._read(update_info, checked)
        try:
            with disable_mtp_completeness_check(), building_in_place():
                self.model.load_weights(iter(tensors))
        finally:
            if arena is not None:
                del tensors
                copy_out_waiting(self.model, arena.address_range)

    def _read(
        self, info: CpuUpdateInfo, tensors: list[tuple[str, Any, list[int], int, int]]
    ) -> list[tuple[str, Any]]:
        """Each tensor copied out of the buffer file into memory of its own: later changes
        to the file (rewritten, truncated, deleted) cannot reach the model or the worker."""
        import torch

        if self._folder_fd is None:
            raise ValueError(f"{REFUSED}: no InitWeightTransfer made a folder for the buffers")
        name = os.path.basename(info.buffer)
        if os.path.normpath(os.path.dirname(info.buffer)) != os.path.normpath(
            self.directory
        ) or name in ("", ".", ".."):
            raise ValueError(
                f"{REFUSED}: buffer {info.buffer!r} is not a file in {self.directory!r}"
                " (the folder InitWeightTransfer answered with)"
            )
        try:
            fd = os.open(
                name,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                dir_fd=self._folder_fd,
            )
        except OSError as exc:
            raise ValueError(f"{REFUSED}: buffer {info.buffer!r}: {exc.strerror}") from None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise ValueError(f"{REFUSED}: buffer {info.buffer!r} is not a regular file")
            if found.st_uid != os.geteuid() or found.st_nlink != 1:
                raise ValueError(
                    f"{REFUSED}: buffer {info.buffer!r} is not a file the trainer made there"
                    " (owned by the engine's user, one link)"
                )
            needed = max((offset + nbytes for *_, offset, nbytes in tensors), default=0)
            if found.st_size < needed:
                raise ValueError(
                    f"{REFUSED}: {info.buffer!r} holds {found.st_size} bytes; the tensors"
                    f" named need {needed}"
                )
            loaded = []
            for tensor_name, dtype, shape, offset, nbytes in tensors:
                data = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    _read_exactly(fd, data.numpy(), offset, info.buffer)
                loaded.append((tensor_name, data.view(dtype).view(shape)))
            return loaded
        finally:
            os.close(fd)

    def _check(self, info: CpuUpdateInfo) -> list[tuple[str, Any, list[int], int, int]]:
        """Each tensor's (name, dtype, shape, offset, bytes): a known dtype, an aligned
        offset (names, shapes and dtypes were checked before, by the worker's guard:
        ``weight_updates.check_chunk``).
        Raises ValueError naming the first that does not fit."""
        import torch

        checked = []
        for name, dtype_name, shape, offset in zip(
            info.names, info.dtype_names, info.shapes, info.offsets, strict=True
        ):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{REFUSED}: tensor {name!r}: unknown dtype {dtype_name!r}")
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not isinstance(offset, int) or offset < 0 or offset % itemsize:
                raise ValueError(
                    f"{REFUSED}: tensor {name!r}: offset {offset!r} is not a multiple of its"
                    f" element size ({itemsize})"
                )
            checked.append((name, dtype, shape, offset, math.prod(shape) * itemsize))
        return checked

    def _close_folder(self) -> None:
        if self._folder_fd is not None:
            os.close(self._folder_fd)
            self._folder_fd = None

    def _close_arena(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def shutdown(self) -> None:
        self._close_folder()
        self._close_arena()


class _MappedArena:
    """The gateway's arena, mapped shared in this worker for as long as the trainer's
    transfer lasts."""

    def __init__(self, path: str, mapping: mmap.mmap, size: int, identity: tuple[int, int]):
        import torch

        self.path = path  # as init named it: a chunk's buffer names the arena by it
        self.size = size
        self.identity = identity  # the memfd's (device, inode)
        self._mapping = mapping
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        start = self.bytes.data_ptr()
        self.address_range = (start, start + size)

    @classmethod
    def open(cls, path: str, size: int, current: _MappedArena | None = None) -> _MappedArena:
        """Map the arena at ``path`` (the gateway's ``/proc/<pid>/fd/<n>``), checked on the
        open descriptor: a regular file of this user of exactly ``size`` bytes, sealed
        against shrinking and growing; ``current`` itself where it is that arena already
        (a trainer's later init: no second mapping). ValueError saying what is wrong."""
        from gateway.weight_buffers import ARENA_SEALS

        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"{REFUSED}: init_info.arena_bytes {size!r} is not a size")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise ValueError(f"{REFUSED}: arena {path!r}: {exc.strerror}") from None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
                raise ValueError(f"{REFUSED}: arena {path!r} is not this user's shared memory")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & ARENA_SEALS != ARENA_SEALS or found.st_size != size:
                raise ValueError(f"{REFUSED}: arena {path!r} is not a sealed block of {size} bytes")
            identity = (found.st_dev, found.st_ino)
            if current is not None and (current.identity, current.size, current.path) == (
                identity,
                size,
                path,
            ):
                return current
            mapping = mmap.mmap(
                fd,
                size,
                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        finally:
            os.close(fd)
        return cls(path, mapping, size, identity)

    def views(self, tensors: list[tuple[str, Any, list[int], int, int]]) -> list[tuple[str, Any]]:
        """Each checked tensor as a view of the arena; ValueError for one past its end."""
        views = []
        for name, dtype, shape, offset, nbytes in tensors:
            if offset + nbytes > self.size:
                raise ValueError(
                    f"{REFUSED}: tensor {name!r} ends at byte {offset + nbytes}, past the"
                    f" arena's {self.size}"
                )
            views.append((name, self.bytes[offset : offset + nbytes].view(dtype).view(shape)))
        return views

    def close(self) -> None:
        del self.bytes
        with contextlib.suppress(BufferError):  # a view still lives: the mapping goes with it
            self._mapping.close()


def copy_out_waiting(model: Any, address_range: tuple[int, int]) -> int:
    """Tensors that vLLM's layerwise reload holds for a layer still waiting for others
    (sent in a later chunk), and that lie in ``address_range`` (the arena), replaced by
    copies of their own: the trainer may rewrite the arena once the chunk is answered.
    How many were copied."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise

    start, end = address_range
    copied = 0
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    address = value.untyped_storage().data_ptr()
                    if start <= address < end:
                        bound.arguments[key] = value.clone()
                        copied += 1
    return copied


def check_private_folder(directory: str) -> int:
    """Open ``directory`` (an absolute path, no link at its end) and check on the open
    descriptor that it is a folder of this process's user that nobody else may enter
    (mode 0700): the gateway made it. Its descriptor; ValueError saying what is wrong."""
    if not isinstance(directory, str) or not os.path.isabs(directory):
        raise ValueError(f"{REFUSED}: init_info.directory {directory!r} is not an absolute path")
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{REFUSED}: folder {directory!r}: {exc.strerror}") from None
    found = os.fstat(fd)
    if found.st_uid != os.geteuid() or found.st_mode & 0o077:
        os.close(fd)
        raise ValueError(
            f"{REFUSED}: folder {directory!r} is not private to the engine's user (mode 0700)"
        )
    return fd


def _read_exactly(fd: int, into: Any, offset: int, path: str) -> None:
    view = memoryview(into).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise ValueError(f"{REFUSED}: {path!r} ended early (changed while it was read)")
        done += got
