"""The parts of the vLLM plugin (and of the adapter) that make an engine work, and fail
legibly, on every machine: AMX permission, worker deaths named with their signal, the CPU
attention path reported, and the cache salt that keeps KV of other weights unused."""

from __future__ import annotations

import multiprocessing
import os
import signal
from types import SimpleNamespace

import pytest

import gateway.vllm.plugin as plugin
from gateway.process_exit import describe_process_exit
from gateway.vllm import args, deaths
from gateway.vllm import engine as adapter
from tests.amx_probe import build_tile_library, machine_has_amx, probe


@pytest.fixture
def fake_amx(monkeypatch):
    """torch reporting AMX tiles; counts the permission requests (torch's ``_init_amx``)."""
    import torch

    asked: list[int] = []

    def init_amx() -> bool:
        asked.append(os.getpid())
        return True

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch._C._cpu, "_init_amx", init_amx)
    monkeypatch.setattr(plugin, "_amx_permission", None)  # as in a new process
    return asked


def test_on_a_cpu_reporting_amx_the_plugin_asks_for_the_tiles_once_per_process(fake_amx):
    plugin.load_vllm_plugin()  # this test process runs vLLM's CPU platform
    assert fake_amx == [os.getpid()]
    plugin.load_vllm_plugin()  # vLLM may load plugins more than once
    assert plugin.allow_amx_tiles() is True
    assert fake_amx == [os.getpid()]


def test_the_tiles_are_never_asked_for_on_other_platforms(fake_amx, monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    plugin.load_vllm_plugin()
    assert fake_amx == []


def test_without_amx_nothing_is_asked(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch._C._cpu, "_init_amx", lambda: pytest.fail("asked for AMX"))
    monkeypatch.setattr(plugin, "_amx_permission", None)
    assert plugin.allow_amx_tiles() is False


def test_a_refused_permission_is_logged_and_reported(fake_amx, monkeypatch, caplog):
    import torch

    monkeypatch.setattr(torch._C._cpu, "_init_amx", lambda: False)
    assert plugin.allow_amx_tiles() is False
    assert "refused this process its tile state" in caplog.text


@pytest.mark.skipif(not machine_has_amx(), reason="this CPU has no AMX (runs on one that has)")
def test_on_a_real_amx_cpu_tile_instructions_need_the_plugins_request(tmp_path):
    """The cause itself, on this machine: a fresh process running one tile instruction dies
    of SIGILL; after ``allow_amx_tiles`` it runs (what vLLM's amx attention needs)."""
    library = build_tile_library(tmp_path)
    bare = probe(library, "bare")
    assert bare.returncode == -signal.SIGILL, bare
    assert "before False" in bare.stdout and "ran" not in bare.stdout
    allowed = probe(library, "plugin")
    assert allowed.returncode == 0, allowed
    assert "allowed True True" in allowed.stdout and "ran 1" in allowed.stdout


def test_signals_that_kill_engine_processes_are_named_with_their_cause():
    sigill = describe_process_exit("VllmWorker-0", -signal.SIGILL)
    assert sigill.startswith("VllmWorker-0 (killed by SIGILL: ")
    assert "instruction this process may not run" in sigill and "AMX" in sigill
    assert "OOM" in describe_process_exit("EngineCore", -signal.SIGKILL)
    assert describe_process_exit("EngineCore", -signal.SIGUSR2) == "EngineCore (SIGUSR2)"
    assert describe_process_exit("EngineCore", 1) == "EngineCore (exit status 1)"
    assert describe_process_exit("EngineCore", None) == "EngineCore"


def _die_of_sigill() -> None:
    os.kill(os.getpid(), signal.SIGILL)


def test_a_dead_workers_signal_reaches_the_gateway_through_the_engine_process(
    tmp_path, monkeypatch
):
    """When a worker dies, vLLM's worker monitor shuts its executor down (which cancels the
    queue the EngineCore's step waits on, so the EngineCore fails and its clients hear only
    "EngineDeadError"), then calls the failure callback. The plugin records the worker and
    its signal before that shutdown cancels anything, where the gateway's ENGINE_DEAD message
    reads it: the report is there however soon the gateway hears of the failure."""
    from vllm.v1.engine.exceptions import EngineDeadError
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    monkeypatch.setattr(deaths.tempfile, "gettempdir", lambda: str(tmp_path))
    plugin.load_vllm_plugin()
    worker = multiprocessing.get_context("spawn").Process(target=_die_of_sigill, name="W-0")
    worker.start()
    worker.join(60)
    assert worker.exitcode == -signal.SIGILL
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.is_failed = False
    executor.workers = [SimpleNamespace(proc=worker, death_writer=None, worker_response_mq=None)]
    reported_when_cancelled: list[str | None] = []
    executor.rpc_broadcast_mq = SimpleNamespace(
        shutdown=lambda: reported_when_cancelled.append(deaths.death_report([os.getpid()]))
    )
    told: list[str] = []
    executor.register_failure_callback(lambda: told.append("engine told"))
    executor.start_worker_monitor(inline=True)  # vLLM's own monitor, run here
    assert told == ["engine told"]
    assert len(reported_when_cancelled) == 1
    assert (reported_when_cancelled[0] or "").startswith("W-0 (killed by SIGILL: ")
    dead = adapter._engine_failure(EngineDeadError(), [os.getpid()])
    assert str(dead).startswith("the engine core failed: W-0 (killed by SIGILL: ")
    # Another engine's report is not this one's; without a report, the generic words.
    assert "gateway's log" in str(adapter._engine_failure(EngineDeadError(), [1]))
    deaths.death_report([os.getpid()], remove=True)
    assert deaths.death_report([os.getpid()]) is None


class _ExitedNotYetReaped:
    """A worker process as the monitor can find it: its sentinel ready (the kernel closed
    its files), its exit status not yet readable until it is joined."""

    def __init__(self, name: str, ended: bool):
        self.name, self.exitcode, self.joined = name, None, False
        self.sentinel, self._write_end = os.pipe()
        if ended:
            os.close(self._write_end)

    def join(self, timeout=None):
        self.joined = True
        self.exitcode = -signal.SIGILL


def test_a_worker_whose_exit_status_lags_its_sentinel_is_still_named(tmp_path, monkeypatch):
    """Seen in CI: the report was written while the dead worker's ``exitcode`` still read
    None (its sentinel fires a moment before it can be reaped), so none was written and the
    client heard "the cause is in the gateway's log". A worker whose sentinel is ready is
    joined first; a live one is not waited for."""
    monkeypatch.setattr(deaths.tempfile, "gettempdir", lambda: str(tmp_path))
    dead, alive = _ExitedNotYetReaped("W-0", ended=True), _ExitedNotYetReaped("W-1", ended=False)
    executor = SimpleNamespace(workers=[SimpleNamespace(proc=alive), SimpleNamespace(proc=dead)])
    try:
        plugin._write_worker_death_report(executor)
        report = deaths.death_report([os.getpid()], remove=True) or ""
        assert report.startswith("W-0 (killed by SIGILL: "), report
        assert dead.joined and not alive.joined
    finally:
        for end in (dead.sentinel, alive.sentinel, alive._write_end):
            os.close(end)


class _MarkedAtTeardown:
    """In a reference cycle: only the interpreter's teardown collection runs ``__del__``."""

    def __init__(self, path: str):
        self.path, self.cycle = path, self

    def __del__(self):
        with open(self.path, "a") as file:
            file.write("teardown\n")


def _a_vllm_child_that_exits(folder: str, status: int | None) -> None:
    import atexit

    plugin._exit_without_the_teardown()
    _MarkedAtTeardown(os.path.join(folder, "marks"))

    def mark_at_exit() -> None:
        with open(os.path.join(folder, "marks"), "a") as file:
            file.write("atexit\n")

    atexit.register(mark_at_exit)
    if status is not None:
        raise SystemExit(status)


@pytest.mark.parametrize(
    ("name", "status", "marks"),
    [
        ("VllmWorker-0", None, "atexit\n"),
        ("EngineCore_DP1", 5, "atexit\n"),
        ("SomeOtherProcess", 5, "atexit\nteardown\n"),  # not vLLM's: the whole teardown
    ],
)
def test_vllm_s_processes_exit_with_their_status_and_handlers_but_no_teardown(
    tmp_path, name, status, marks
):
    """vLLM's EngineCore and worker processes skip the interpreter's teardown (~2 s of
    garbage collection each, on the 2-core VM): their exit status and exit handlers stay."""
    child = multiprocessing.get_context("spawn").Process(
        target=_a_vllm_child_that_exits, args=(str(tmp_path), status), name=name
    )
    child.start()
    child.join(60)
    assert child.exitcode == (status or 0)
    assert (tmp_path / "marks").read_text() == marks


def test_the_cpu_attention_path_is_vllms_own_pick_for_the_model():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from gateway.vllm import engine_config
    from tests.conftest import cpu_engine_args

    config = engine_config(cpu_engine_args())
    isa = args.cpu_attention_isa(config)
    want = _get_attn_isa(
        config.model_config.dtype,
        config.cache_config.block_size,
        config.model_config.get_head_size(),
        config.cache_config.cache_dtype,
    )
    assert isa == want and isa in ("amx", "vec", "vec16", "neon", "vsx", "vxe", "rvv")


def bare_engine(version: str | None) -> adapter.VllmEngine:
    engine = adapter.VllmEngine.__new__(adapter.VllmEngine)
    engine.weight_version = version
    engine._weights_epoch = 0
    engine._salts = {}
    return engine


def test_the_cache_salt_names_the_weights_and_keeps_the_clients_salt_apart():
    engine = bare_engine("v1")
    plain, salted = engine._cache_salt(None, 0), engine._cache_salt("tenant", 0)
    assert plain != salted and salted.endswith("tenant")
    assert engine._cache_salt(None, 0) == plain  # same weights, same salt: cache hits
    engine.weight_version = "v2"
    assert engine._cache_salt(None, 0) != plain
    engine.weight_version = "v1"
    assert engine._cache_salt(None, 0) == plain
    engine._weights_epoch += 1  # a change under the same version (none given)
    assert engine._cache_salt(None, 0) != plain
    assert engine._cache_salt(None, 1) != engine._cache_salt(None, 2)  # adapter loads
    # No client salt passes for another version's key.
    forged = bare_engine(None)._cache_salt(engine._cache_salt(None, 0), 0)
    assert forged not in {engine._cache_salt(None, 0), engine._cache_salt("", 0)}
    assert bare_engine(None)._cache_salt(None, 0) != plain


async def test_a_weight_change_moves_the_salt_from_its_start_even_when_it_fails():
    engine = bare_engine("v1")
    before = engine._cache_salt(None, 0)
    during = []

    async def failing_reload() -> None:
        with engine._changing_weights():
            during.append(engine._cache_salt(None, 0))
            raise RuntimeError("failed part-way")

    with pytest.raises(RuntimeError):
        await failing_reload()
    after = engine._cache_salt(None, 0)
    assert len({before, during[0], after}) == 3
