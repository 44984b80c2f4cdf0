"""Whole processes for tests: the gateway CLI and vLLM's own CLI, each in its own process
group so that stopping one kills every process it started (engines, DP coordinator).

A process group, not a session: Linux schedules each session as one autogroup, and on the
2-core box an engine's two busy threads in a session of their own starved the test's
client (a different session) for seconds at a time, long past its heartbeat timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from tests.conftest import TEST_KV_CACHE_BYTES, TEST_MAX_MODEL_LEN, ipc_address
from tests.helpers import kill_all

ROOT = Path(__file__).resolve().parents[1]


def _process_env(extra: dict | None, own_rpc_folder: bool) -> dict[str, str]:
    """This session's environment plus ``extra``; with ``own_rpc_folder``, less the
    session's socket folder for vLLM (tests/conftest.py): a gateway under test makes its
    own, as in production."""
    env = {**os.environ, **(extra or {})}
    session_folder = env.get("VLLM_RPC_BASE_PATH", "").rsplit("/", 1)[-1]
    if own_rpc_folder and session_folder.startswith("eg-rpc-tests-"):
        del env["VLLM_RPC_BASE_PATH"]
    return env


class Process:
    """A command in its own process group, its output in ``log_path``; ``stop`` kills them
    all."""

    own_rpc_folder = False  # a gateway: makes its own folder for vLLM's sockets

    def __init__(self, argv: list[str], log_path: Path, env: dict | None = None):
        self.argv = argv
        self.log = open(log_path, "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=_process_env(env, self.own_rpc_folder),
            process_group=0,
        )

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.proc.pid).children(recursive=True)
        return []

    def pids_named(self, fragment: str) -> list[int]:
        """Processes under this one whose name or command line contains ``fragment``.
        Reading a command line can block for seconds (the process's memory lock): async
        tests call this through ``asyncio.to_thread``, keeping their sessions alive."""
        pids = []
        for child in self.descendants():
            with contextlib.suppress(psutil.NoSuchProcess):
                if fragment in " ".join([*child.cmdline(), child.name()]):
                    pids.append(child.pid)
        return pids

    def engine_core_pids(self) -> list[int]:
        """vLLM EngineCore processes under this one (named EngineCore or EngineCore_DP<r>)."""
        return self.pids_named("EngineCore")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        orphans = [p.pid for p in self.descendants()]
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        kill_all(orphans)
        if self.log.closed:  # stopped before
            return
        # Shown by pytest only when the test failed (captured teardown output).
        print(f"--- output of {' '.join(self.argv[1:5])} (last 6000 chars) ---")
        print(self.output()[-6000:])
        self.log.close()


class GatewayProcess(Process):
    """`python -m gateway serve` on the tiny model in a subprocess, with its own engine."""

    own_rpc_folder = True

    def __init__(self, *extra: str, address: str | None = None, env: dict | None = None):
        self.address = address or ipc_address("proc")
        super().__init__(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--bind",
                self.address,
                "--max-model-len",
                str(TEST_MAX_MODEL_LEN),
                "--kv-cache-memory-bytes",
                str(TEST_KV_CACHE_BYTES),
                *extra,
            ],
            Path(self.address.removeprefix("ipc://")).with_suffix(".log"),
            env,
        )
