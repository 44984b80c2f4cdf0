"""``VllmEngine``: the adapter the server talks to (the Engine Protocol and
``EngineControls``), over vLLM's ``AsyncMPClient``.

Owns: request validation through vLLM's InputProcessor and sampling defaults from the
model's generation config (as vLLM's OpenAI server), the cache salt that names the weights
a request is admitted under, the control plane (pause, weights, versions, LoRA), engine
deaths as ``EngineDead`` with their cause, and each step's outputs for the session table.
vLLM is imported inside functions only; nothing outside ``gateway.vllm`` imports vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from copy import copy
from typing import Any

from codec import EngineLoad, EngineStats, ErrorCode, Generate
from codec import SamplingParams as WireSamplingParams

from ..engine import EngineControls, EngineInfo, sample_engine_request_id
from ..errors import EngineDead, RequestRejected, SubmitFailed, WeightsIncomplete
from ..process_exit import EXIT_POLL_S
from ..routing import RoutingConfig
from .args import cpu_attention_isa, engine_config
from .deaths import death_report
from .failures import engine_death_named as _engine_death_named
from .failures import engine_failure as _engine_failure
from .failures import files_call as _files_call
from .launch import (
    EngineGroup,
    describe_exit,
    exiting,
    set_engine_environment,
    watch_output_socket,
)
from .multimodal import MultimodalInputs
from .outputs import ConvertedOutput, stopping_eos_token_ids, to_wire_logprobs
from .prefix_routing import PrefixRouting
from .transfer import WeightTransferControls, check_transfer_backend
from .weight_updates import RELOAD_PART_WAY

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


_GATEWAY_LORA_IDS = 1_000_000  # LoRA ids each gateway of a group has for LoadLora


class LoraModuleRefused(Exception):
    """A ``--lora-module`` adapter vLLM could not load at start; the message names it."""


def _every_layer_reloaded(results: Any) -> bool:
    """Whether every worker's reload (the plugin's result, perhaps nested per engine) gave
    new weights to every layer a complete checkpoint fills; a worker that could not tell
    (no plan of the served checkpoint) counts as whole, as before counts existed."""
    states = []
    pending = [results]
    while pending:
        item = pending.pop()
        if isinstance(item, (list, tuple)):
            pending.extend(item)
        elif isinstance(item, dict):
            states.append(item)
    return bool(states) and all(
        s.get("layers", 0) == 0 or s.get("layers_updated", 0) >= s["layers"] for s in states
    )


class VllmEngine(PrefixRouting, WeightTransferControls, EngineControls):
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
        self._init_routing()
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
        self._multimodal: MultimodalInputs | None = None
        if model_config.is_multimodal_model:
            processor = self._processor.renderer.get_mm_processor()
            self._multimodal = MultimodalInputs.for_model(processor, model_config)
        self.last_encoder_cache_counts: dict[str, int] = {}
        self._encoder_poll: asyncio.Task | None = None
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
            multimodal=self._multimodal.wire_schemas() if self._multimodal is not None else {},
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
        routing: RoutingConfig | None = None,
    ) -> VllmEngine:
        """Start an EngineCore process for ``engine_args`` (vLLM's AsyncEngineArgs).

        ``vllm_config``: from ``engine_config(engine_args)`` when already made.
        ``engine_stats``: vLLM's ``log_stats``: per-request events (queued, scheduled)
        for ``Finished.timings`` and scheduler stats for ``engine_stats()`` (GetStats);
        ~9% of throughput on the 2-core CPU box (docs/PERFORMANCE.md).
        ``client_config``: from ``launch_engine_group``: attach to engines started there
        (this is one of several gateways) instead of starting them.
        ``routing``: the rank policy for unpinned requests (gateway/routing.py; default
        ``load``, vLLM's balancer); ``cache`` needs ``enable_kv_events`` on the args.
        """
        from vllm.v1.engine.core_client import EngineCoreClient
        from vllm.v1.executor import Executor

        if vllm_config is None:
            vllm_config = engine_config(engine_args)  # checks the backend itself
        else:
            check_transfer_backend(vllm_config)  # a config made elsewhere
        set_engine_environment(vllm_config)
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
        watch_output_socket(client)
        try:
            tasks = tuple(await client.get_supported_tasks_async())
            engine = cls(vllm_config, client, tasks)
            engine._start_routing(routing or RoutingConfig())
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
        if engine._multimodal is not None:
            engine._encoder_poll = asyncio.create_task(engine._poll_encoder_cache_counts())
        return engine

    # ------------------------------------------------------------ Engine Protocol

    def prepare(self, engine_request_id: str, request: Generate) -> list[Any]:
        """Validate ``request`` as vLLM's frontend does; one EngineCoreRequest per sample."""
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind

        if self.weights_incomplete is not None:
            raise WeightsIncomplete(self.weights_incomplete)
        try:
            prompt = request.prompt_token_ids
            self._check_token_ids(prompt, "Token id {} is out of vocabulary")
            params = self._sampling_params(request, len(prompt))
            params.detokenize = False
            params.output_kind = (
                RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
            )
            n = params.n
            if n > 1 and params.seed is not None and params.seed + n - 1 > _INT64_MAX:
                # Before _process, which routes: a refused request is placed nowhere.
                raise RequestRejected(
                    f"seed + n - 1 must be at most {_INT64_MAX} (sample i of n uses seed + i),"
                    f" got seed={params.seed} and n={n}."
                )
            core_request = self._process(engine_request_id, request, params)
        except RequestRejected:
            raise
        except (VLLMValidationError, ValueError, TypeError, OverflowError) as exc:
            raise RequestRejected(str(exc)) from None
        if n == 1:
            return [core_request]
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
        self._moved_prediction(core_request, [child.request_id for child in children])
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
            self._placed_by_engine_client(core_request)

    async def abort_requests(self, engine_request_ids: Sequence[str]) -> None:
        if engine_request_ids and not self._client.resources.engine_dead:
            await self._client.abort_requests_async(list(engine_request_ids))
            self._generation_aborted(engine_request_ids)

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
        if self._predicted:
            self._note_prefill(outputs)
        if self.placed_sequences:
            self._follow_generation(outputs)
        for i, out in enumerate(outputs):
            if out.new_logprobs is not None or out.new_prompt_logprobs_tensors is not None:
                outputs[i] = self._convert(out)
        return outputs

    # ------------------------------------------------------------ control plane

    async def pause(self, mode: str, clear_cache: bool) -> None:
        """vLLM's pause_scheduler: "abort", "wait" (returns once drained) or "keep"."""
        with _engine_death_named(self._engine_pids):
            await self._client.pause_scheduler_async(mode, clear_cache)
        if clear_cache:  # vLLM reset every engine's prefix cache, running requests' too
            self._prefix_cache_cleared()

    async def resume(self) -> None:
        """vLLM's resume_scheduler; refused (INVALID_REQUEST, vLLM's words) while a pause is
        still under way, or a weight update another gateway of the group opened is open."""
        await _files_call("Resume", self._client.resume_scheduler_async(), self._engine_pids)

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        """vLLM's reset_prefix_cache on every engine; its result (False: not reset)."""
        with _engine_death_named(self._engine_pids):
            reset = bool(await self._client.reset_prefix_cache_async(reset_running))
        if reset:
            # vLLM publishes its AllBlocksCleared with its next step's events, which an
            # idle engine may not take for long: the index forgets the blocks now.
            self._prefix_cache_cleared()
        return reset

    async def reload_weights(self, path: str, version: str | None) -> dict[str, Any]:
        """vLLM's reload_weights from ``path`` on every worker, then a prefix-cache reset
        (cached KV came from the old weights) and the new version, if given. Requests
        admitted from its start on never reuse KV of other weights (``_cache_salt``)."""
        with self._changing_weights():
            try:
                results = await _files_call(
                    "ReloadWeights",
                    self._client.collective_rpc_async(
                        "reload_weights", kwargs={"weights_path": path}
                    ),
                    self._engine_pids,
                )
            except RequestRejected as exc:
                if RELOAD_PART_WAY not in exc.message:
                    raise  # refused before any weight moved: the old ones serve on
                # The model now mixes two sets of weights: as a weight update failed part-way.
                self.weights_incomplete = (
                    f"{exc.message}; generation is refused until a complete weight update or a"
                    " ReloadWeights of a whole checkpoint"
                )
                raise WeightsIncomplete(self.weights_incomplete) from None
            if self.weights_incomplete is not None and _every_layer_reloaded(results):
                logger.info("a whole checkpoint ended the mixed-weights state")
                self.weights_incomplete = None
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
        if level >= 1:  # vLLM dropped its KV cache (the events index hears it from vLLM)
            self._approximate_cache_dropped()

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

    async def _poll_encoder_cache_counts(self, interval_s: float = 5.0) -> None:
        """Keep ``last_encoder_cache_counts`` fresh for the metrics."""
        while not self._closed:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(Exception):  # a dying engine: its death is told elsewhere
                await self.encoder_cache_counts()

    async def encoder_cache_counts(self) -> dict[str, int]:
        """The engines' encoder cache hits and encoder runs (the plugin counts them); also
        kept for the metrics (``last_encoder_cache_counts``)."""
        if self._multimodal is None or self._client.resources.engine_dead:
            return {}
        from .plugin import ENCODER_CACHE_COUNTS

        per_engine = await self._client.call_utility_all_async(ENCODER_CACHE_COUNTS)
        counts = {
            "encoder_cache_hits": sum(c["hits"] for c in per_engine),
            "encoder_runs": sum(c["encoder_runs"] for c in per_engine),
        }
        self.last_encoder_cache_counts = counts
        return counts

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
            # The coordinator's counts are a snapshot (and this client's own placements add
            # to them until the next): a gateway alone on its engines knows better, since
            # every request there is one of its own in flight.
            alone = getattr(client, "client_count", 1) == 1
            loads = []
            for rank, identity, (waiting, running, kv) in zip(
                client.engine_ranks_managed, client.core_engines, counts, strict=False
            ):
                mine = in_flight[identity]
                running, waiting = int(running), int(waiting)
                if alone:
                    running = min(running, mine)
                    waiting = min(waiting, mine - running)
                loads.append(EngineLoad(rank, running, waiting, float(kv), mine))
            return loads
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
            if self._encoder_poll is not None:
                self._encoder_poll.cancel()
            await self._stop_routing()
            if self.weight_buffers is not None:
                self.weight_buffers.remove()
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

    def _process(
        self, engine_request_id: str, request: Generate, params: Any, route: bool = True
    ) -> Any:
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
        salt = self._cache_salt(client_salt, lora_load)
        if request.multimodal:
            if self._multimodal is None:
                raise RequestRejected(
                    f"model {self.info.model_name!r} takes no multimodal items",
                    ErrorCode.UNSUPPORTED,
                )
            prompt = self._multimodal.build(request.prompt_token_ids, request.multimodal, salt)
        else:
            prompt = tokens_input(list(request.prompt_token_ids), cache_salt=salt)
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
        if route:
            self._route(core_request, options.routing_key if options is not None else None)
        return core_request

    def prefix_query(
        self, prompt_token_ids: list[int], options: Any
    ) -> tuple[list[int | None], int, str]:
        """PrefixQuery: per rank, the prompt's tokens cached there (``prefix_matches``),
        the block size and the routing policy; the prompt is checked as a Generate's."""
        matched, block_size = self.prefix_matches(self._query_request(prompt_token_ids, options))
        policy = self.router.config.policy if self.router is not None else "load"
        return matched, block_size, policy

    def prompt_block_hashes(self, prompt_token_ids: list[int], options: Any = None) -> list[Any]:
        """vLLM's block hashes of a request for this prompt (as KV events carry them);
        empty without an index."""
        hasher, index = self._hasher, self.prefix_index
        if hasher is None or index is None:
            return []
        core_request = self._query_request(prompt_token_ids, options)
        return hasher.block_hashes(core_request, index.block_size() or hasher.block_size)

    def _query_request(self, prompt_token_ids: list[int], options: Any) -> Any:
        """The EngineCoreRequest a Generate of this prompt would make (not routed)."""
        from vllm.exceptions import VLLMValidationError

        request = Generate("prefix-query", prompt_token_ids, False, WireSamplingParams(), options)
        try:
            self._check_token_ids(prompt_token_ids, "Token id {} is out of vocabulary")
            params = self._sampling_params(request, len(prompt_token_ids))
            params.detokenize = False
            return self._process("prefix-query", request, params, route=False)
        except RequestRejected:
            raise
        except (VLLMValidationError, ValueError, TypeError, OverflowError) as exc:
            raise RequestRejected(str(exc)) from None

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
    def _convert(out: Any) -> ConvertedOutput:
        sample = out.new_logprobs
        prompt = out.new_prompt_logprobs_tensors
        return ConvertedOutput(
            request_id=out.request_id,
            new_token_ids=out.new_token_ids,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            new_logprobs=None
            if sample is None
            else to_wire_logprobs(
                sample.logprob_token_ids, sample.logprobs, sample.sampled_token_ranks
            ),
            new_prompt_logprobs_tensors=None
            if prompt is None
            else to_wire_logprobs(
                prompt.logprob_token_ids, prompt.logprobs, prompt.selected_token_ranks
            ),
            prefill_stats=out.prefill_stats,
            kv_transfer_params=out.kv_transfer_params,
            events=out.events,
        )
