"""vLLM's layerwise reload, from outside: check a set of tensors against the served model
before any weight moves, count the layers that took new weights, and undo a reload that
stopped part-way. Runs in vLLM's worker processes (used by ``plugin`` for reloads from disk
and by ``weight_updates`` for in-memory updates)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "abandon_reload",
    "building_in_place",
    "holds_kernel_memory",
    "checkpoint_shapes",
    "dry_run_layers",
    "dry_run_load",
    "layer_processing",
]


# safetensors' dtype names (the header's "dtype"), for the meta tensors of a dry run.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def checkpoint_shapes(path: str, load_config: Any) -> dict[str, tuple[list[int], Any]] | None:
    """Each tensor's shape and torch dtype in the safetensors checkpoint at ``path``, from
    its headers; None where there are no headers to read (another load format, or only
    ``*.bin`` files). Raises ValueError for a folder without weights or an unreadable file."""
    import glob

    import torch
    from safetensors import safe_open
    from vllm.model_executor.model_loader.weight_utils import filter_duplicate_safetensors_files

    if load_config.load_format not in ("auto", "safetensors"):
        return None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        if load_config.load_format == "auto" and glob.glob(os.path.join(path, "*.bin")):
            return None
        raise ValueError(f"{path!r} holds no weight files (*.safetensors)")
    try:
        files = filter_duplicate_safetensors_files(files, path, "model.safetensors.index.json")
    except FileNotFoundError as exc:
        raise ValueError(f"{path!r}: {exc}") from None
    shapes: dict[str, tuple[list[int], Any]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (not a dict)
                    tensor = f.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype(), "float32")
                    shapes[name] = (tensor.get_shape(), getattr(torch, dtype))
        except Exception as exc:  # safetensors' own error type differs between releases
            raise ValueError(f"{file!r} is not a readable safetensors file: {exc}") from None
    return shapes


def dry_run_load(model: Any, shapes: dict[str, tuple[list[int], Any]]) -> dict[str, int]:
    """The model's ``load_weights`` on meta tensors, inside vLLM's layerwise reload with its
    per-layer processing held back, then every layer put back as it was. Returns how many
    elements each layer (by module name) would receive. Raises ValueError naming the tensor
    the model refused (no place for it, or another shape)."""
    return {name: elements for name, (elements, _) in dry_run_layers(model, shapes).items()}


def dry_run_layers(
    model: Any, shapes: dict[str, tuple[list[int], Any]]
) -> dict[str, tuple[int, frozenset[str]]]:
    """``dry_run_load``, also telling which of the checkpoint's tensors each layer takes:
    module name -> (elements, tensor names)."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise

    current: tuple[str, list[int]] = ("", [])
    feeds: dict[int, set[str]] = {}  # id(layer) -> names of the tensors it received
    counted: dict[int, int] = {}  # id(layer) -> elements seen at the last look

    def attribute(name: str) -> None:
        """Give ``name`` to every layer whose element count moved since the last look."""
        for module in model.modules():
            info = layerwise.LAYERWISE_INFO.get(module)
            if info is None or not info.can_load():
                continue
            key = id(module)
            if info.load_numel != counted.get(key, 0):
                counted[key] = info.load_numel
                feeds.setdefault(key, set()).add(name)

    def meta_tensors() -> Iterator[tuple[str, Any]]:
        nonlocal current
        for name, (shape, dtype) in shapes.items():
            if current[0]:
                attribute(current[0])  # the previous tensor is loaded by now
            current = (name, shape)
            yield name, torch.empty(shape, dtype=dtype, device="meta")

    with layer_processing(lambda process, layer, info: None):
        layerwise.initialize_layerwise_reload(model)
        try:
            model.load_weights(meta_tensors())
            if current[0]:
                attribute(current[0])
        except (ValueError, KeyError, AssertionError, IndexError) as exc:
            name, shape = current
            why = repr(exc)  # vLLM may list every parameter of the model: cut it short
            why = why if len(why) <= 400 else f"{why[:400]}..."
            raise ValueError(f"tensor {name!r} of shape {shape}: {why}") from None
        else:
            return {
                module_name: (info.load_numel, frozenset(feeds.get(id(layer), ())))
                for module_name, layer in model.named_modules()
                if (info := layerwise.LAYERWISE_INFO.get(layer)) is not None
                and info.can_load()
                and info.load_numel > 0
            }
        finally:
            abandon_reload(model)


@contextlib.contextmanager
def layer_processing(replacement: Callable[[Any, Any, Any], None]) -> Iterator[None]:
    """Within: vLLM's layerwise reload calls ``replacement(process, layer, info)`` where it
    would process a layer whose weights all arrived (``process(layer, info)``)."""
    from vllm.model_executor.model_loader.reload import layerwise

    process = layerwise._layerwise_process
    layerwise._layerwise_process = lambda layer, info: replacement(process, layer, info)
    try:
        yield
    finally:
        layerwise._layerwise_process = process


def abandon_reload(model: Any) -> None:
    """End vLLM's layerwise reload where it stopped: each layer it has not finished (waiting
    on the meta device, or half-built, while its old tensors are kept aside) gets those
    old tensors back. Layers it finished keep their new weights."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    layerwise.LOADING_LAYERS.clear()


@contextlib.contextmanager
def building_in_place() -> Iterator[None]:
    """Within: vLLM's layerwise reload builds a layer whose tensors all arrived in the
    memory of the tensors it replaces, wherever that tensor has the same shape, strides,
    dtype and device, instead of in fresh memory that it then copies over them (its copy
    back becomes a no-op: torch skips a copy of memory onto itself). A layer is built only
    once all its tensors arrived, so a layer still waiting keeps its old tensors whole; a
    layer that fails while being built holds part of its new weights
    (``holds_kernel_memory``). Fresh memory costs a page fault per page, and on a VM the
    host's too: building 2.3 GiB of layers fresh took several times a memcpy. Tensors that
    processing turns into another shape (packed, quantized) are built fresh, as before."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise, meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    original = layerwise.materialize_layer

    def materialize(layer: Any, info: Any) -> None:
        if layer.__class__.__name__ in meta.SKIP_MODULES:
            return
        kernel: dict[str, Any] = {}
        if info.kernel_tensors is not None:
            kernel = {**info.kernel_tensors[1], **info.kernel_tensors[0]}
        device = torch.device(info.restore_device)
        with info.restore_device:
            for name, tensor in get_layer_tensors(layer).items():
                if name in meta.SKIP_TENSORS or not tensor.is_meta:
                    continue
                old = kernel.get(name)
                fits = (
                    isinstance(old, torch.Tensor)
                    and not old.is_meta
                    and old.device.type == device.type
                    and old.dtype == tensor.dtype
                    and old.shape == tensor.shape
                    and old.stride() == tensor.stride()
                )
                setattr(
                    layer,
                    name,
                    _in_memory_of(old, tensor) if fits else meta.materialize_meta_tensor(tensor),
                )

    layerwise.materialize_layer = materialize
    try:
        yield
    finally:
        layerwise.materialize_layer = original


def _in_memory_of(old: Any, meta_tensor: Any) -> Any:
    """A tensor like ``meta_tensor`` (its class and attributes: the weight loader) on the
    memory of ``old``."""
    import torch

    tensor = torch.empty(0, dtype=old.dtype, device=old.device).set_(
        old.untyped_storage(), old.storage_offset(), old.size(), old.stride()
    )
    tensor.requires_grad_(False)
    tensor.__class__ = meta_tensor.__class__
    tensor.__dict__ = meta_tensor.__dict__.copy()
    return tensor


def holds_kernel_memory(layer: Any, info: Any) -> bool:
    """Is ``layer`` being built in the memory of its old tensors (``building_in_place``)?
    Then a failure part-way has already overwritten some of them."""
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if info.kernel_tensors is None:
        return False
    kernel = [*info.kernel_tensors[0].values(), *info.kernel_tensors[1].values()]
    addresses = {t.untyped_storage().data_ptr() for t in kernel if not t.is_meta}
    return any(
        not tensor.is_meta
        and all(tensor is not k for k in kernel)
        and tensor.untyped_storage().data_ptr() in addresses
        for tensor in get_layer_tensors(layer).values()
    )
