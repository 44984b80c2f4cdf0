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
truncate or rewrite it then. Runs in vLLM's worker processes.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .weight_updates import REFUSED

__all__ = ["CpuInitInfo", "CpuUpdateInfo", "CpuWeightTransferEngine", "check_private_folder"]


@dataclass
class CpuInitInfo(WeightTransferInitInfo):
    directory: str = ""


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
        self._close_folder()
        self.directory, self._folder_fd = init_info.directory, folder_fd

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which CPU-only torch
        # lacks; loading from copies is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CpuUpdateInfo) -> None:
        tensors = self._read(update_info, self._check(update_info))
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with disable_mtp_completeness_check():
            self.model.load_weights(iter(tensors))

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

    def shutdown(self) -> None:
        self._close_folder()


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
