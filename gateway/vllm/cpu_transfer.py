"""The ``cpu`` weight-transfer backend (registered by the plugin): a trainer on the engine's
host writes tensors into a shared-memory file; each worker maps it and loads the tensors
through vLLM's layerwise reload, with no copy between the mapping and ``load_weights``.

Wire maps (PROTOCOL.md §7.14): ``init_info`` ``{"directory": str}`` (optional; default
``/dev/shm``: buffers must lie in it). ``update_info`` ``{"buffer": path, "names": [str],
"dtype_names": [str], "shapes": [[int]], "offsets": [int]}``: tensor i is
``shapes[i]`` elements of ``dtype_names[i]`` (torch names), little-endian, C order, at byte
``offsets[i]`` of the file (aligned to the element size). Every name, dtype and shape is
checked against the served checkpoint before any tensor is read: a wrong one is refused and
nothing moves. Runs in vLLM's worker processes.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .weight_updates import REFUSED, update_plan

__all__ = ["CpuInitInfo", "CpuUpdateInfo", "CpuWeightTransferEngine"]

DEFAULT_DIRECTORY = "/dev/shm"
_FLOATING = ("float64", "float32", "float16", "bfloat16")


@dataclass
class CpuInitInfo(WeightTransferInitInfo):
    directory: str = DEFAULT_DIRECTORY


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
        self.directory = os.path.realpath(DEFAULT_DIRECTORY)
        self._mappings: list[mmap.mmap] = []  # views into them wait in unfinished layers

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
        directory = os.path.realpath(init_info.directory)
        if not os.path.isdir(directory):
            raise ValueError(f"{REFUSED}: {init_info.directory!r} is not a folder here")
        self.directory = directory

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self.release_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which CPU-only torch
        # lacks; loading from a mapping is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CpuUpdateInfo) -> None:
        import torch

        tensors = self._check(update_info)
        with open(update_info.buffer, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            needed = max((offset + nbytes for _, _, _, offset, nbytes in tensors), default=0)
            if size < needed:
                raise ValueError(
                    f"{REFUSED}: {update_info.buffer!r} holds {size} bytes; the tensors"
                    f" named need {needed}"
                )
            if size == 0:
                return
            # A private mapping: writable for torch.frombuffer, never written back.
            mapping = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY)
        self._mappings.append(mapping)
        raw = torch.frombuffer(mapping, dtype=torch.uint8)

        def named_tensors() -> Any:
            for name, dtype, shape, offset, nbytes in tensors:
                yield name, raw[offset : offset + nbytes].view(dtype).view(shape)

        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with disable_mtp_completeness_check():
            self.model.load_weights(named_tensors())

    def _check(self, info: CpuUpdateInfo) -> list[tuple[str, Any, list[int], int, int]]:
        """Each tensor's (name, dtype, shape, offset, bytes), once all are known good:
        the buffer is a file in the directory, and each name, dtype, shape and offset fits
        the served checkpoint. Raises ValueError naming the first that does not."""
        import torch

        path = os.path.realpath(info.buffer)
        if os.path.dirname(path) != self.directory or not os.path.isfile(path):
            raise ValueError(
                f"{REFUSED}: buffer {info.buffer!r} is not a file in {self.directory!r}"
                " (init_info.directory)"
            )
        plan = update_plan(self._default_model, self.vllm_config, compute=False)
        checked = []
        for name, dtype_name, shape, offset in zip(
            info.names, info.dtype_names, info.shapes, info.offsets, strict=True
        ):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{REFUSED}: tensor {name!r}: unknown dtype {dtype_name!r}")
            if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
                raise ValueError(
                    f"{REFUSED}: tensor {name!r}: shape {shape!r} is not a list of sizes"
                )
            if plan is not None:
                if name not in plan.shapes:
                    raise ValueError(
                        f"{REFUSED}: tensor {name!r} is not in the served model's checkpoint"
                    )
                want_shape, want_dtype = plan.shapes[name]
                if list(want_shape) != shape:
                    raise ValueError(
                        f"{REFUSED}: tensor {name!r} has shape {shape}; the served model"
                        f" takes {list(want_shape)}"
                    )
                if dtype != want_dtype and not (
                    str(dtype_name) in _FLOATING and str(want_dtype)[6:] in _FLOATING
                ):
                    raise ValueError(
                        f"{REFUSED}: tensor {name!r} has dtype {dtype_name}; the served model"
                        f" takes {str(want_dtype)[6:]}"
                    )
            itemsize = torch.empty((), dtype=dtype).element_size()
            if not isinstance(offset, int) or offset < 0 or offset % itemsize:
                raise ValueError(
                    f"{REFUSED}: tensor {name!r}: offset {offset!r} is not a multiple of its"
                    f" element size ({itemsize})"
                )
            checked.append((name, dtype, shape, offset, math.prod(shape) * itemsize))
        return checked

    def release_update(self) -> None:
        """Let go of this update's mappings (their tensors now live in the model)."""
        mappings, self._mappings = self._mappings, []
        for mapping in mappings:
            # A view still alive somewhere: the GC unmaps it later.
            with contextlib.suppress(BufferError):
                mapping.close()

    def shutdown(self) -> None:
        self.release_update()
