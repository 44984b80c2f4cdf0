"""What engine-gateway relies on in vLLM, in one place: ``CONTRACT``.

Each entry is ``"module:Name"`` (the name importable from the module), ``"module:Name.member"``
(an attribute, method or field of it: on a class, or on what the name is), or
``"module:Name(param, ...)"`` (parameters a callable must take by these names; a class's
``__init__`` or its fields). The gateway (``gateway/vllm/``), the plugin it loads into every
vLLM process, and the client's vLLM helpers (``client/vllm_*.py``,
``client/multimodal_processor.py``) use nothing of vLLM beyond this list; a test keeps the
list complete (every ``from vllm... import`` of the repository is in it) and checks it
against the installed vLLM (``check_installed``) and against the source of each release the
project means to support, read from its wheel without installing it (``check_wheel``).

``ADAPTED`` names, per release, the entries that release changes and the code that adapts to
the change; anything else it changes is a failure of the test.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["ADAPTED", "CONTRACT", "RELEASES", "Entry", "check_installed", "check_wheel", "parse"]

CONTRACT: tuple[str, ...] = (
    # -- configuration, arguments, start-up
    "vllm:envs",
    "vllm.envs:VLLM_CPU_OMP_THREADS_BIND",
    "vllm.config:ModelConfig",
    "vllm.config:set_current_vllm_config",
    "vllm.config.kv_events:KVEventsConfig",
    "vllm.engine.arg_utils:AsyncEngineArgs.add_cli_args",
    "vllm.engine.arg_utils:AsyncEngineArgs.from_cli_args",
    "vllm.engine.arg_utils:AsyncEngineArgs.create_engine_config",
    "vllm.utils.argparse_utils:FlexibleArgumentParser",
    "vllm.usage.usage_lib:UsageContext.OPENAI_API_SERVER",
    "vllm.entrypoints.cli.main:main",
    "vllm.entrypoints.serve.utils.api_utils:get_max_tokens",
    "vllm.logger:init_logger",
    "vllm.platforms:current_platform",
    "vllm.exceptions:VLLMValidationError",
    "vllm.tokenizers.registry:cached_tokenizer_from_config",
    "vllm.utils.hashing:get_hash_fn_by_name",
    # -- the engine core and its client
    "vllm.v1.engine.core:EngineCore._initialize_kv_caches",
    "vllm.v1.engine.core:EngineCore.resume_scheduler",
    "vllm.v1.engine.core_client:EngineCoreClient.make_async_mp_client(vllm_config, "
    "executor_class, log_stats, client_addresses, client_count, client_index)",
    "vllm.v1.engine.core_client:EngineCoreClient.add_request_async",
    "vllm.v1.engine.core_client:EngineCoreClient.abort_requests_async",
    "vllm.v1.engine.core_client:EngineCoreClient.get_output_async",
    "vllm.v1.engine.core_client:AsyncMPClient.call_utility_async",
    "vllm.v1.engine.core_client:AsyncMPClient.call_utility_all_async",
    "vllm.v1.engine.core_client:EngineCoreClient.collective_rpc_async",
    "vllm.v1.engine.core_client:EngineCoreClient.get_supported_tasks_async",
    "vllm.v1.engine.core_client:EngineCoreClient.shutdown",
    "vllm.v1.engine.core_client:AsyncMPClient.resume_scheduler_async",
    "vllm.v1.engine.coordinator:DPCoordinatorProc.run_coordinator",
    "vllm.v1.engine.exceptions:EngineDeadError",
    "vllm.v1.engine.input_processor:InputProcessor(vllm_config)",
    "vllm.v1.engine.input_processor:InputProcessor.process_inputs(request_id, prompt, params,"
    " supported_tasks, arrival_time, lora_request, priority, data_parallel_rank)",
    "vllm.v1.engine.utils:EngineZmqAddresses",
    "vllm.v1.engine.utils:get_engine_zmq_bind_addresses",
    "vllm.v1.engine.utils:launch_core_engines(vllm_config, executor_class, log_stats, addresses)",
    "vllm.v1.engine:EngineCoreOutputs.outputs",
    "vllm.v1.engine:EngineCoreOutputs.engine_index",
    "vllm.v1.engine:EngineCoreOutputs.scheduler_stats",
    "vllm.v1.engine:EngineCoreOutput.request_id",
    "vllm.v1.engine:EngineCoreOutput.new_token_ids",
    "vllm.v1.engine:EngineCoreOutput.new_logprobs",
    "vllm.v1.engine:EngineCoreOutput.new_prompt_logprobs_tensors",
    "vllm.v1.engine:EngineCoreOutput.finish_reason",
    "vllm.v1.engine:EngineCoreOutput.stop_reason",
    "vllm.v1.engine:EngineCoreOutput.events",
    "vllm.v1.engine:EngineCoreOutput.kv_transfer_params",
    "vllm.v1.engine:EngineCoreOutput.prefill_stats",
    "vllm.v1.request:Request.from_engine_core_request",
    "vllm.v1.serial_utils:MsgpackDecoder",
    "vllm.v1.serial_utils:MsgpackEncoder",
    "vllm.v1.outputs:ModelRunnerOutput",
    "vllm.v1.executor:Executor.get_class",
    "vllm.v1.executor.abstract:Executor.__init__",
    "vllm.v1.executor.multiproc_executor:MultiprocExecutor.shutdown",
    "vllm.v1.executor.uniproc_executor:UniProcExecutor",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner._sample",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner._bookkeeping_sync",
    "vllm.v1.attention.backends.cpu_attn:_get_attn_isa",
    # -- requests
    "vllm.sampling_params:SamplingParams",
    "vllm.sampling_params:RequestOutputKind.DELTA",
    "vllm.sampling_params:RequestOutputKind.FINAL_ONLY",
    "vllm.inputs.engine:tokens_input",
    "vllm.inputs.engine:mm_input",
    "vllm.lora.request:LoRARequest",
    "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter(lora_request)",
    "vllm.lora.worker_manager:WorkerLoRAManager.remove_adapter(adapter_id)",
    # -- prefix caching and cache routing
    "vllm.v1.core:kv_cache_utils",
    "vllm.v1.core.kv_cache_utils:init_none_hash",
    "vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys",
    "vllm.v1.core.kv_cache_utils:hash_block_tokens",
    "vllm.v1.core.kv_cache_utils:maybe_convert_block_hash",
    "vllm.v1.core.encoder_cache_manager:EncoderCacheManager.allocate(request, input_id)",
    "vllm.v1.core.encoder_cache_manager:EncoderCacheManager.check_and_update_cache(request,"
    " input_id)",
    "vllm.distributed.kv_events:EventPublisherFactory._registry",
    "vllm.distributed.kv_events:ZmqEventPublisher.offset_endpoint_port(endpoint,"
    " data_parallel_rank)",
    # -- weights
    "vllm.v1.worker.gpu_worker:Worker.reload_weights",
    "vllm.v1.worker.gpu_worker:Worker.start_weight_update",
    "vllm.v1.worker.gpu_worker:Worker.update_weights",
    "vllm.v1.worker.gpu_worker:Worker.finish_weight_update",
    "vllm.model_executor.model_loader.reload:layerwise",
    "vllm.model_executor.model_loader.reload.layerwise:LAYERWISE_INFO",
    "vllm.model_executor.model_loader.reload.layerwise:LOADING_LAYERS",
    "vllm.model_executor.model_loader.reload.layerwise:_layerwise_process(layer, info)",
    "vllm.model_executor.model_loader.reload.layerwise:_place_kernel_tensors(layer, info)",
    "vllm.model_executor.model_loader.reload.layerwise:initialize_layerwise_reload",
    "vllm.model_executor.model_loader.reload.layerwise:materialize_layer",
    "vllm.model_executor.model_loader.reload:meta",
    "vllm.model_executor.model_loader.reload.meta:SKIP_MODULES",
    "vllm.model_executor.model_loader.reload.meta:SKIP_TENSORS",
    "vllm.model_executor.model_loader.reload.meta:materialize_meta_tensor",
    "vllm.model_executor.model_loader.reload:initialize_layerwise_reload",
    "vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
    "vllm.model_executor.model_loader.reload.utils:get_layer_tensors",
    "vllm.model_executor.model_loader.weight_utils:filter_duplicate_safetensors_files",
    "vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check",
    "vllm.distributed.weight_transfer:WeightTransferEngineFactory._registry",
    "vllm.distributed.weight_transfer:WeightTransferEngineFactory.register_engine",
    "vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory._registry",
    "vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory.register_engine",
    "vllm.distributed.weight_transfer.base:ModuleSource",
    "vllm.distributed.weight_transfer.base:TrainerInitInfo",
    "vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine",
    "vllm.distributed.weight_transfer.base:VLLMWeightSyncClient",
    "vllm.distributed.weight_transfer.base:WeightSource",
    "vllm.distributed.weight_transfer.base:WeightTransferEngine",
    "vllm.distributed.weight_transfer.base:WeightTransferInitInfo",
    "vllm.distributed.weight_transfer.base:WeightTransferUpdateInfo",
    "vllm.distributed.weight_transfer.clients:HTTPVLLMWeightSyncClient",
    # -- multimodal
    "vllm.multimodal:MULTIMODAL_REGISTRY",
    "vllm.multimodal.inputs:MultiModalFieldElem",
    "vllm.multimodal.inputs:MultiModalFlatField",
    "vllm.multimodal.inputs:MultiModalKwargsItem",
    "vllm.multimodal.inputs:MultiModalKwargsItems",
    "vllm.multimodal.inputs:PlaceholderRange",
    "vllm.multimodal.processing.inputs:ProcessorInputs",
    "vllm.multimodal.processing.processor:TimingContext",
    "vllm.model_executor.models:vision",
    "vllm.model_executor.models.vision:get_vision_encoder_info",
    "vllm.model_executor.models.clip:CLIPEncoderInfo",
    "vllm.model_executor.models.clip:CLIPVisionConfig",
    "vllm.model_executor.models.siglip:SiglipEncoderInfo",
    "vllm.model_executor.models.siglip:SiglipVisionConfig",
    "vllm.model_executor.models.registry:ModelRegistry._try_load_model_cls",
)

# Per release read from its wheel: the entries it changes (as check_wheel reports them)
# and what adapts to each. 0.32.0 is the release the CPU engine runs (the pin); 0.33.0 keeps
# every entry (read 2026-12-02) but is not run here (no CPU wheel of it yet), so the pin
# stays below it (README, pyproject.toml).
RELEASES = ("0.33.0",)
ADAPTED: dict[str, dict[str, str]] = {"0.33.0": {}}

_ENTRY = re.compile(
    r"^(?P<module>[\w.]+):(?P<name>\w+)(?:\.(?P<member>\w+))?(?:\((?P<params>.*)\))?$"
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One use: ``module``'s ``name``, and of it ``member``, and ``params`` it takes."""

    text: str
    module: str
    name: str
    member: str | None
    params: tuple[str, ...]


def parse(text: str) -> Entry:
    match = _ENTRY.match(text)
    if match is None:
        raise ValueError(f"not a contract entry: {text!r}")
    params = tuple(p.strip() for p in (match["params"] or "").split(",") if p.strip())
    return Entry(text, match["module"], match["name"], match["member"], params)


# ---------------------------------------------------------------- the installed vLLM


def check_installed(entries: Iterable[str] = CONTRACT) -> list[str]:
    """The entries the installed vLLM does not keep, each with why; [] when all hold."""
    problems = []
    for text in entries:
        entry = parse(text)
        try:
            _check_one_installed(entry)
        except Exception as exc:  # noqa: BLE001 - each failure reported, with its cause
            problems.append(f"{text}: {type(exc).__name__}: {exc}")
    return problems


def _check_one_installed(entry: Entry) -> None:
    module = importlib.import_module(entry.module)
    if not hasattr(module, entry.name):
        importlib.import_module(f"{entry.module}.{entry.name}")  # a submodule
    target = getattr(module, entry.name)
    if entry.member is not None:
        if not _has_member(target, entry.member):
            raise AttributeError(f"{entry.name} has no {entry.member}")
        target = getattr(target, entry.member, None)
    if entry.params:
        taken = _parameters(target)
        missing = [p for p in entry.params if p not in taken]
        if missing:
            raise TypeError(f"takes no {missing} (takes {sorted(taken)})")


def _has_member(target: Any, member: str) -> bool:
    if hasattr(target, member):
        return True
    fields = getattr(target, "__struct_fields__", ()) or ()
    fields = set(fields) | set(getattr(target, "__dataclass_fields__", {}) or {})
    fields |= set(getattr(target, "model_fields", {}) or {})
    fields |= set(getattr(target, "__annotations__", {}) or {})
    return member in fields


def _parameters(target: Any) -> set[str]:
    if inspect.isclass(target):
        fields = getattr(target, "__struct_fields__", None)
        if fields:
            return set(fields)
        target = target.__init__
    return set(inspect.signature(target).parameters)


# ---------------------------------------------------------------- a release's wheel


def check_wheel(wheel: Path, entries: Iterable[str] = CONTRACT) -> list[str]:
    """The entries the release in ``wheel`` (vLLM's, read as source, never imported) does
    not keep, each with why; [] when all hold."""
    source = _WheelSource(wheel)
    problems = []
    for text in entries:
        entry = parse(text)
        why = source.check(entry)
        if why is not None:
            problems.append(f"{text}: {why}")
    return problems


class _WheelSource:
    """vLLM's modules as syntax trees, from a wheel (or a folder holding ``vllm/``)."""

    def __init__(self, wheel: Path):
        if wheel.is_dir():
            self._read = lambda name: (wheel / name).read_bytes()
            self._files = {str(p.relative_to(wheel)) for p in (wheel / "vllm").rglob("*.py")}
        else:
            archive = zipfile.ZipFile(wheel)
            self._read = archive.read
            self._files = set(archive.namelist())
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = module.replace(".", "/")
            for name in (f"{path}.py", f"{path}/__init__.py"):
                if name in self._files:
                    tree = ast.parse(self._read(name))
                    tree._is_init = name.endswith("__init__.py")  # type: ignore[attr-defined]
                    self._trees[module] = tree
                    break
            else:
                self._trees[module] = None
        return self._trees[module]

    def check(self, entry: Entry) -> str | None:
        found = self.find(entry.module, entry.name)
        if found is None:
            return f"{entry.module} defines no {entry.name}"
        module, node = found
        if node is _ELSEWHERE:
            return None  # another package's name: not vLLM's to keep
        if entry.member is not None:
            if not isinstance(node, ast.ClassDef):
                if isinstance(node, ast.Module) or node is _MODULE_ASSIGN:
                    return (
                        None
                        if self._module_member(module, entry, node)
                        else (f"{entry.name} has no {entry.member}")
                    )
                return None  # an object the source builds: its members are not read here
            member = self.member(module, node, entry.member)
            if member is None:
                return f"{entry.name} has no {entry.member}"
            node = member
        if entry.params:
            taken = self.parameters(module, node)
            if taken is not None:
                missing = [p for p in entry.params if p not in taken]
                if missing:
                    return f"takes no {missing} (takes {sorted(taken)})"
        return None

    def _module_member(self, module: str, entry: Entry, node: Any) -> bool:
        submodule = f"{module}.{entry.name}"
        return self.find(submodule, entry.member) is not None

    def find(self, module: str, name: str, depth: int = 0) -> tuple[str, Any] | None:
        """Where ``module``'s ``name`` is defined: (module, its node), following imports."""
        if depth > 8:
            return None
        tree = self.tree(module)
        if tree is None:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name == name:
                    return module, node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    built = node.value
                    if isinstance(built, ast.Call) and isinstance(built.func, ast.Name):
                        cls = self.find(module, built.func.id, depth + 1)  # NAME = Class(...)
                        if cls is not None and isinstance(cls[1], ast.ClassDef):
                            return cls
                    return module, _MODULE_ASSIGN
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, tree)
                        if source.split(".")[0] != "vllm":  # a name vLLM re-exports
                            return source, _ELSEWHERE
                        found = self.find(source, alias.name, depth + 1)
                        if found is not None:
                            return found
                        if self.tree(f"{source}.{alias.name}") is not None:
                            return f"{source}.{alias.name}", self.tree(f"{source}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name:
                        return alias.name, self.tree(alias.name)
        if self.tree(f"{module}.{name}") is not None:  # a submodule
            return f"{module}.{name}", self.tree(f"{module}.{name}")
        if name == "__getattr__":
            return None
        lazy = self.find(module, "__getattr__", depth + 1)  # vllm.envs: a module __getattr__
        if lazy is not None and _names_string(self.tree(module), name):
            return module, _MODULE_ASSIGN
        return None

    def member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> Any:
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
            ):
                return node
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                return node
        if depth > 8:
            return None
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is None:
                continue
            found = self.find(module, base_name)
            if found is not None and isinstance(found[1], ast.ClassDef):
                member = self.member(found[0], found[1], name, depth + 1)
                if member is not None:
                    return member
        return None

    def parameters(self, module: str, node: Any) -> set[str] | None:
        if isinstance(node, ast.ClassDef):
            init = self.member(module, node, "__init__")
            if init is not None:
                return self.parameters(module, init)
            return {
                n.target.id
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            return set(names)
        return None


_MODULE_ASSIGN = object()  # a module-level variable (its members are not read from source)
_ELSEWHERE = object()  # a name the module imports from outside vLLM (transformers, torch)


def _top_level(tree: ast.Module) -> Iterable[ast.stmt]:
    """The module's statements, with those under top-level ``if``/``try`` (TYPE_CHECKING,
    optional imports) too."""
    for node in tree.body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for child in ast.walk(node):
                if isinstance(child, ast.stmt) and child is not node:
                    yield child


def _absolute(module: str, node: ast.ImportFrom, tree: ast.Module) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")  # a package's __init__ is its own package; a module is not
    base = package[: len(package) - node.level + 1] if _is_init(tree) else package[: -node.level]
    return ".".join(base + ([node.module] if node.module else []))


def _is_init(tree: ast.Module) -> bool:
    return bool(getattr(tree, "_is_init", False))


def _names_string(tree: ast.Module | None, name: str) -> bool:
    """Whether ``name`` appears as a string key in ``tree`` (vllm.envs' table of lazily
    read variables)."""
    if tree is None:
        return False
    return any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree))
