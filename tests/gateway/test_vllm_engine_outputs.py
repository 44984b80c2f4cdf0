"""VllmEngine.run_outputs against a stand-in for vLLM's client (its outputs queue and
exception formatting only): the hand-over rules, without an engine, and the watch on the
engine processes (real child processes standing in for engines). The real engine's output
task is pinned in test_vllm_engine.py, its death in test_data_parallel.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
from multiprocessing import connection
from pathlib import Path
from types import SimpleNamespace

import pytest

from gateway.errors import EngineDead
from gateway.vllm import EngineGroup, VllmEngine, stopping_eos_token_ids
from tests.gateway.test_process_exit import main_thread_exits_while_a_thread_lingers, sleep_forever


class StandInClient:
    def __init__(self) -> None:
        self.outputs_queue: asyncio.Queue = asyncio.Queue()
        self.resources = SimpleNamespace(engine_dead=False, engine_manager=None)

    def _format_exception(self, exc: Exception) -> Exception:
        return RuntimeError(f"formatted {exc}")


def engine_on(client: StandInClient) -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # no vLLM config: only the output path
    engine._client = client
    engine._closed = False
    engine._watched = []
    engine._exit_poll = None
    engine._engine_pids = []
    engine._stats = {}
    engine.weight_version = None
    engine._init_routing()
    return engine


def step(*request_ids: str, weight_version: str | None = None) -> SimpleNamespace:
    outputs = [
        SimpleNamespace(request_id=r, new_logprobs=None, new_prompt_logprobs_tensors=None)
        for r in request_ids
    ]
    return SimpleNamespace(outputs=outputs, weight_version=weight_version, scheduler_stats=None)


async def test_steps_before_and_after_the_call_arrive_in_order_then_death_raises():
    client = StandInClient()
    engine = engine_on(client)
    seen: list[tuple[list[str], str | None]] = []

    def on_step(outputs):
        seen.append(([o.request_id for o in outputs], engine.weight_version))

    client.outputs_queue.put_nowait(step("a"))  # queued before anyone listened
    runner = asyncio.ensure_future(engine.run_outputs(on_step))
    await asyncio.sleep(0)
    client.outputs_queue.put_nowait(step("b", "c", weight_version="v2"))
    client.outputs_queue.put_nowait(step("d", weight_version="v2"))
    assert seen == [(["a"], None), (["b", "c"], "v2"), (["d"], "v2")]  # delivered inline
    client.outputs_queue.put_nowait(ValueError("socket closed"))
    with pytest.raises(EngineDead, match="formatted socket closed"):
        await asyncio.wait_for(runner, 5)
    assert "put_nowait" not in vars(client.outputs_queue)  # the queue is vLLM's again
    client.outputs_queue.put_nowait(step("late"))
    assert len(seen) == 3 and client.outputs_queue.qsize() == 1


async def test_a_failing_handler_is_raised_as_itself_and_later_steps_are_not_handled():
    client = StandInClient()
    engine = engine_on(client)
    calls = []

    def on_step(outputs):
        calls.append(outputs)
        raise KeyError("a gateway bug")

    runner = asyncio.ensure_future(engine.run_outputs(on_step))
    await asyncio.sleep(0)
    client.outputs_queue.put_nowait(step("a"))
    client.outputs_queue.put_nowait(step("b"))  # vLLM's task goes on; nobody handles it
    with pytest.raises(KeyError, match="a gateway bug"):
        await asyncio.wait_for(runner, 5)
    assert len(calls) == 1


async def test_once_vllm_stops_the_engines_a_step_ends_the_call_as_engine_death():
    """After an engine died vLLM ABORTs the others' requests: no client asked for that."""
    client = StandInClient()
    engine = engine_on(client)
    seen = []
    runner = asyncio.ensure_future(engine.run_outputs(seen.append))
    await asyncio.sleep(0)
    client.outputs_queue.put_nowait(step("a"))
    client.resources.engine_dead = True
    client.outputs_queue.put_nowait(step("a"))
    with pytest.raises(EngineDead, match="vLLM stopped the others"):
        await asyncio.wait_for(runner, 5)
    assert len(seen) == 1


async def test_a_client_without_a_plain_queue_is_pulled_from_instead():
    client = StandInClient()
    client.outputs_queue = SimpleNamespace()  # not an asyncio.Queue: vLLM changed shape

    async def get_output_async():
        return step("pulled")

    client.get_output_async = get_output_async
    engine = engine_on(client)
    seen = []

    def on_step(outputs):
        seen.append(outputs[0].request_id)
        if len(seen) == 2:
            raise EngineDead("enough")

    with pytest.raises(EngineDead, match="enough"):
        await asyncio.wait_for(engine.run_outputs(on_step), 5)
    assert seen == ["pulled", "pulled"]


@pytest.fixture(params=[sleep_forever])
def engine_processes(request):
    """Two spawned processes standing in for an engine and a DP coordinator; the engine
    runs the parameter (sleep_forever unless a test says otherwise)."""
    spawn = multiprocessing.get_context("spawn")
    started = [
        spawn.Process(target=request.param, name="EngineCore_DP0"),
        spawn.Process(target=sleep_forever, name="Coord"),
    ]
    for process in started:
        process.start()
    yield started
    for process in started:
        process.kill()
        process.join(10)


def watched(engine_processes) -> tuple[StandInClient, VllmEngine]:
    client = StandInClient()
    engine_core, coordinator = engine_processes
    client.resources.engine_manager = SimpleNamespace(processes=[engine_core])
    client.resources.coordinator = SimpleNamespace(proc=coordinator)
    engine = engine_on(client)
    engine._watch_engine_processes(asyncio.get_running_loop())
    return client, engine


@pytest.mark.parametrize("dies", [0, 1], ids=["engine", "coordinator"])
async def test_an_engine_or_coordinator_exit_ends_the_call_as_engine_death_naming_it(
    engine_processes, dies
):
    client, engine = watched(engine_processes)
    runner = asyncio.ensure_future(engine.run_outputs(lambda outputs: None))
    await asyncio.sleep(0)
    client.outputs_queue.put_nowait(step("a"))
    doomed = engine_processes[dies]
    os.kill(doomed.pid, signal.SIGKILL)
    with pytest.raises(EngineDead, match=rf"{doomed.name} \(killed by SIGKILL: .*\) exited"):
        await asyncio.wait_for(runner, 10)


LINGERING = pytest.mark.parametrize(
    "engine_processes", [main_thread_exits_while_a_thread_lingers], indirect=True
)


@LINGERING
async def test_an_engine_whose_main_thread_exited_is_dead_before_its_pipes_close(
    engine_processes,
):
    """A killed engine's last thread once held its pipes open for 25 s (process_exit.py):
    the watch sees the main thread's exit instead of waiting for the sentinel."""
    client, engine = watched(engine_processes)
    runner = asyncio.ensure_future(engine.run_outputs(lambda outputs: None))
    with pytest.raises(EngineDead, match=r"EngineCore_DP0 \(exit status 0\) exited"):
        await asyncio.wait_for(runner, 10)
    assert not connection.wait([engine_processes[0].sentinel], 0)  # still open
    assert not engine._watched and engine._exit_poll is None


@LINGERING
def test_the_supervisors_watch_sees_the_main_thread_exit_too(engine_processes):
    engine_core, coordinator = engine_processes
    group = EngineGroup(SimpleNamespace(processes=[engine_core]), SimpleNamespace(proc=coordinator))
    deaths: queue.Queue[str] = queue.Queue()
    group.watch(deaths.put)
    assert deaths.get(timeout=10) == "EngineCore_DP0 (exit status 0)"
    assert not connection.wait([engine_core.sentinel], 0)


async def test_exits_after_the_gateway_closed_the_engine_are_not_deaths(engine_processes):
    client, engine = watched(engine_processes)
    runner = asyncio.ensure_future(engine.run_outputs(lambda outputs: None))
    await asyncio.sleep(0)
    engine._closed = True  # as aclose() sets it before vLLM stops the engines
    engine_processes[0].kill()
    async with asyncio.timeout(10):
        while engine._watched:  # the watch ends at the first exit
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert not runner.done()
    runner.cancel()


@pytest.mark.parametrize(
    ("generation_config", "tokenizer_eos", "want"),
    [
        ({"eos_token_id": [2, 3]}, None, [2, 3]),
        ({"eos_token_id": 7}, None, [7]),
        ({"bos_token_id": 1}, None, []),  # generation_config.json without EOS ids
        ({}, None, []),
        ({"eos_token_id": [2, 3]}, 3, [3, 2]),  # the tokenizer's first, not twice
        ({}, 9, [9]),
    ],
)
def test_the_eos_ids_listed_are_those_vllm_stops_on(generation_config, tokenizer_eos, want):
    assert stopping_eos_token_ids(generation_config, tokenizer_eos) == want


def test_the_vllm_plugin_is_registered_and_patches_each_part_once():
    import importlib.metadata

    from gateway.vllm.plugin import _run_dp_coordinator, load_vllm_plugin

    (entry,) = [
        e
        for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        if e.name == "engine-gateway"
    ]
    assert entry.load() is load_vllm_plugin
    load_vllm_plugin()
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.v1.engine.coordinator import DPCoordinatorProc
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample, reload = CPUModelRunner._sample, CPUWorker.reload_weights
    assert reload.__module__ == "gateway.vllm.plugin"  # checked and undone on failure
    load_adapter = LRUCacheWorkerLoRAManager._load_adapter  # from a private copy
    assert load_adapter.__module__ == "gateway.vllm.plugin"
    assert sample is not GPUModelRunner._sample  # wrapped on the CPU runner only
    # vLLM's DP coordinator processes start through the gateway's parent watch.
    assert DPCoordinatorProc.run_coordinator is _run_dp_coordinator
    original = DPCoordinatorProc._engine_gateway_run_coordinator
    load_vllm_plugin()  # vLLM may load plugins more than once in a process
    assert CPUModelRunner._sample is sample and CPUWorker.reload_weights is reload
    assert LRUCacheWorkerLoRAManager._load_adapter is load_adapter
    assert DPCoordinatorProc._engine_gateway_run_coordinator is original
    assert original is not _run_dp_coordinator


def test_an_adapter_is_loaded_from_a_private_copy_made_at_its_first_load(tmp_path, monkeypatch):
    import gateway.vllm.plugin as adapter_module
    from gateway.vllm.plugin import _adapter_source

    # Copies under tmp_path, not this (test) process's own folder of copies.
    (tmp_path / "copies").mkdir()
    monkeypatch.setattr(adapter_module, "_adapter_copies_root", str(tmp_path / "copies"))
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    copies: dict[int, str] = {}
    copy = _adapter_source(copies, 7, str(folder))
    assert copy != str(folder) and copies == {7: copy}
    (folder / "adapter_config.json").write_text('{"rewritten": true}')
    assert _adapter_source(copies, 7, str(folder)) == copy  # later loads: the same copy
    assert (Path(copy) / "adapter_config.json").read_text() == "{}"
    # Not a local folder (a hub id): vLLM's own way.
    assert _adapter_source(copies, 8, "org/adapter") == "org/adapter" and 8 not in copies

    def full_disk(folder: str, lora_id: int) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(adapter_module, "_copy_adapter", full_disk)
    # Not vLLM reading the client's folder instead: the copy is there to prevent that.
    with pytest.raises(RuntimeError, match="could not be copied for loading") as refused:
        _adapter_source(copies, 9, str(folder))
    assert "No space left on device" in str(refused.value) and 9 not in copies


def test_adapter_copies_of_gone_processes_are_removed(tmp_path):
    import subprocess

    from gateway.vllm.plugin import _remove_copies_of_gone_processes

    gone = subprocess.Popen(["true"])
    gone.wait()
    roots = {
        "gone": tmp_path / f"engine-gateway-lora-{gone.pid}-abc",
        "alive": tmp_path / f"engine-gateway-lora-{os.getpid()}-def",
        "other": tmp_path / "engine-gateway-lora-notapid-x",
    }
    for root in roots.values():
        (root / "1").mkdir(parents=True)
    _remove_copies_of_gone_processes(str(tmp_path))
    assert {name for name, root in roots.items() if root.exists()} == {"alive", "other"}
