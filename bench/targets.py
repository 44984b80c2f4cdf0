"""Benchmark targets: each starts its frontend, streams requests, reports frontend CPU.

All targets serve the same model with the same engine flags. "Frontend CPU" is the
gateway process, or vLLM's API server process (engine-core processes excluded),
or, for the direct client, the benchmark process itself (as in shared/ANCHORS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from client import AsyncClient, SamplingParams

from .engine_counters import (
    STEPS_DIR_ENV,
    EngineCounters,
    frontend_cpu_seconds,
    read_engine_counters,
)
from .workload import RequestRecord, RunResult, Workload

__all__ = [
    "ENGINE_FLAGS",
    "EngineSetup",
    "GatewayGroupServer",
    "GatewayPoolTarget",
    "GatewayServer",
    "GatewayTarget",
    "HttpTarget",
    "HttpFaceTarget",
    "GrpcTarget",
    "DirectTarget",
]

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 2048  # or the model's own context, when shorter
ENGINE_FLAGS = [
    "--enforce-eager",
    "--gpu-memory-utilization",
    "0.2",
    "--skip-tokenizer-init",
]


DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (2-core box)
ZERO_EXECUTOR = "bench.zero_engine.ZeroComputeExecutor"


@dataclass(frozen=True)
class EngineSetup:
    """What every target's engine gets beyond ENGINE_FLAGS: vLLM flags and environment.

    ``executor``: "zero" runs vLLM's EngineCore with no model compute
    (bench/zero_engine.py); ``data_parallel_size`` > 1 starts that many engines (one
    core each here); ``cuda_graphs`` (GPU engines) drops ``--enforce-eager`` so that vLLM
    captures CUDA graphs, as it does by default on a GPU; ``max_model_len`` is every
    engine's context; ``max_num_seqs`` (when set) caps the requests in one engine step (vLLM's
    default is 128 on the CPU, 1024 on an H100).
    """

    executor: str = "model"
    data_parallel_size: int = 1
    cuda_graphs: bool = False
    max_model_len: int = MAX_MODEL_LEN
    max_num_seqs: int | None = None
    extra_flags: tuple[str, ...] = ()  # more vLLM flags, as they are

    @property
    def flags(self) -> list[str]:
        flags = [f for f in ENGINE_FLAGS if not (self.cuda_graphs and f == "--enforce-eager")]
        flags += ["--max-model-len", str(self.max_model_len), *self.extra_flags]
        if self.max_num_seqs is not None:
            flags += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.executor == "zero":
            flags += ["--distributed-executor-backend", ZERO_EXECUTOR]
        if self.data_parallel_size > 1:
            flags += ["--data-parallel-size", str(self.data_parallel_size)]
        return flags

    @property
    def env(self) -> dict[str, str]:
        return dict(DP_ENV) if self.data_parallel_size > 1 else {}

    def with_dp(self, size: int) -> EngineSetup:
        return dataclasses.replace(self, data_parallel_size=size)


async def _record(generate: Any, prompt: list[int], max_tokens: int) -> RequestRecord:
    """One greedy streaming request through a client library ``generate``, timed."""
    record = RequestRecord(start=time.monotonic())
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        async for out in generate(prompt, sampling):
            record.got(len(out.new_token_ids))
    except Exception as exc:  # counted, not raised: a benchmark reports errors
        record.error = repr(exc)
    record.end = time.monotonic()
    return record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # smg-grpc-servicer: no KV-event publisher on all interfaces, no 5-minute warm-up.
    env.setdefault("SMG_VLLM_SERVICER_KV_EVENTS", "0")
    env.setdefault("SMG_VLLM_SERVICER_WARMUP", "off")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class _Process:
    """A server subprocess whose log goes to a file; always stopped.

    It gets its own process group (so stop() can kill its engine processes too)
    but stays in this session. With Linux's sched_autogroup (on by default), a
    new session is a new scheduling group: the client here then competed, as a
    group, with the server's busy-polling EngineCore for one core, and first
    tokens arrived 100-250 ms late in bursts at concurrency 1.
    """

    def __init__(self, argv: list[str], log_name: str, env: dict[str, str] | None = None):
        self.log_path = Path(tempfile.mkdtemp(prefix="eg-bench-")) / log_name
        self.steps_dir = self.log_path.parent
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**_env(), STEPS_DIR_ENV: str(self.steps_dir), **(env or {})},
            cwd=ROOT,
            process_group=0,  # killpg-able, same session: see the docstring
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def engine_counters(self) -> EngineCounters:
        """The engine side's counters so far: see bench/engine_counters.py."""
        return read_engine_counters(self.pid, self.steps_dir)

    def tail(self) -> str:
        return self.log_path.read_text()[-3000:]

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray engine processes
        self._log.close()


async def wait_http_healthy(port: int, process: _Process, timeout_s: float = 300) -> None:
    """Until ``GET /health`` on ``port`` answers 200; raises with the log's tail when the
    server exits first or ``timeout_s`` passes."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline and process.proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(1)
    raise RuntimeError(f"vllm serve did not start:\n{process.tail()}")


class GatewayServer:
    """`python -m gateway serve` on the tiny model, bound to ipc:// and tcp:// at once."""

    def __init__(
        self,
        model: str,
        extra_flags: tuple[str, ...] = (),
        setup: EngineSetup | None = None,
    ):
        setup = setup or EngineSetup()
        self.ipc = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/bench.sock"
        self.tcp = f"tcp://127.0.0.1:{_free_port()}"
        self.process = _Process(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                model,
                "--bind",
                self.ipc,
                "--bind",
                self.tcp,
                "--max-in-flight-per-client",
                "100000",
                "--max-in-flight-total",
                "100000",
                *extra_flags,
                *setup.flags,
            ],
            "gateway.log",
            env=setup.env,
        )

    def stop(self) -> None:
        self.process.stop()


class FakeGatewayServer:
    """The gateway on the fake engine (bench.fake_server), for smoke tests of this CLI."""

    def __init__(self) -> None:
        self.ipc = f"ipc://{tempfile.mkdtemp(prefix='eg-')}/fake.sock"
        self.fake = self.ipc
        self.process = _Process(
            [
                sys.executable,
                "-m",
                "bench.fake_server",
                "--bind",
                self.ipc,
                "--step-interval",
                "0.001",
            ],
            "fake-gateway.log",
        )

    def stop(self) -> None:
        self.process.stop()


class GatewayTarget:
    """engine-gateway over one transport, driven by the client library."""

    def __init__(
        self, server: GatewayServer | FakeGatewayServer, transport: str, name: str | None = None
    ):
        self.name = name or f"gateway-{transport}"
        self.server = server
        self.address = getattr(server, transport)
        self._client: AsyncClient | None = None

    async def start(self) -> None:
        self._client = AsyncClient(
            self.address, name="bench", connect_timeout_s=300, heartbeat_interval_s=5.0
        )
        try:
            await self._client.connect()
        except Exception as exc:
            raise RuntimeError(f"gateway did not start:\n{self.server.process.tail()}") from exc

    def frontend_cpu_s(self) -> float:
        return _cpu_seconds(self.server.process.pid)

    def engine_counters(self) -> EngineCounters:
        return self.server.process.engine_counters()

    async def stream(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        assert self._client is not None
        return await _record(self._client.generate, prompt, max_tokens)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def stream_generate_route(
    session: Any, url: str, prompt: list[int], max_tokens: int
) -> RequestRecord:
    """One streamed request to a ``/inference/v1/generate`` route (vLLM's or the face's)."""
    record = RequestRecord(start=time.monotonic())
    body = {
        "token_ids": prompt,
        "stream": True,
        "sampling_params": {
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "detokenize": False,
        },
    }
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                record.got(sum(len(c.get("token_ids") or ()) for c in chunk.get("choices", ())))
    except Exception as exc:
        record.error = repr(exc)
    record.end = time.monotonic()
    return record


class _GenerateRouteTarget:
    """A server of vLLM's ``/inference/v1/generate`` route (``self.process`` on
    ``self.port``), driven over HTTP with SSE streaming."""

    port: int
    url: str
    process: _Process
    _session: Any = None

    async def start(self) -> None:
        import aiohttp

        await wait_http_healthy(self.port, self.process)
        # Keep-alive below uvicorn's 5 s, or reused connections fail (shared/ANCHORS.md).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        )

    async def stream(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        return await stream_generate_route(self._session, self.url, prompt, max_tokens)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        self.process.stop()


class HttpTarget(_GenerateRouteTarget):
    """vLLM's tokens-in/tokens-out endpoint (`vllm serve --tokens-only`), SSE streaming."""

    def __init__(
        self,
        model: str,
        dev_mode: bool = False,
        setup: EngineSetup | None = None,
        api_servers: int = 1,
        name: str = "vllm-http",
    ):
        """``dev_mode``: VLLM_SERVER_DEV_MODE=1, which mounts /pause, /resume, ...
        ``api_servers``: vLLM's --api-server-count (frontend processes sharing the port)."""
        setup = setup or EngineSetup()
        self.name = name
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/inference/v1/generate"
        self.process = _Process(
            [
                sys.executable,
                "-m",
                "bench.vllm_cli",
                "serve",
                model,
                "--tokens-only",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-log-stats",
                "--uvicorn-log-level",
                "warning",
                "--api-server-count",
                str(api_servers),
                *setup.flags,
            ],
            "vllm-serve.log",
            env={**setup.env, **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})},
        )

    def frontend_cpu_s(self) -> float:
        return frontend_cpu_seconds(self.process.pid)

    def engine_counters(self) -> EngineCounters:
        return self.process.engine_counters()


class HttpFaceTarget(_GenerateRouteTarget):
    """``engine-gateway http`` (client.http_face) over the gateway's ipc address: vLLM's
    generate route served by the face. Frontend CPU: the gateway's and the face's."""

    def __init__(self, server: GatewayServer, name: str = "gateway-http"):
        self.name = name
        self.server = server
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/inference/v1/generate"
        self.process = _Process(
            [
                sys.executable,
                "-m",
                "client.http_face",
                "--gateway",
                server.ipc,
                "--port",
                str(self.port),
                "--connect-timeout",
                "300",
                # One load generator, one caller: the whole budget, as vllm serve gives it.
                "--max-in-flight-per-caller",
                "1000000",
            ],
            "http-face.log",
        )

    def frontend_cpu_s(self) -> float:
        return _cpu_seconds(self.server.process.pid) + _cpu_seconds(self.process.pid)

    def engine_counters(self) -> EngineCounters:
        return self.server.process.engine_counters()


class GrpcTarget:
    """vLLM's gRPC frontend (`vllm serve --grpc`, smg-grpc-servicer), grpc.aio client.

    Streaming counts only the chunks (the final GenerateComplete repeats the last
    chunk's tokens); non-streaming counts the GenerateComplete's output_ids.
    """

    def __init__(self, model: str, stream: bool = True, setup: EngineSetup | None = None):
        setup = setup or EngineSetup()
        self.name = "vllm-grpc" if stream else "vllm-grpc-final"
        self.stream_mode = stream
        self.port = _free_port()
        self.process = _Process(
            [
                sys.executable,
                "-m",
                "bench.vllm_cli",
                "serve",
                model,
                "--grpc",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--disable-log-stats",
                *setup.flags,
            ],
            "vllm-grpc.log",
            env=setup.env,
        )
        self._channel: Any = None
        self._stub: Any = None
        self._ids = 0

    async def start(self) -> None:
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2 as pb
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

        self._pb = pb
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self._stub = pb_grpc.VllmEngineStub(self._channel)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.proc.poll() is None:
            record = await self.stream([5, 6, 7], 2)
            if record.error is None:
                return
            await asyncio.sleep(1)
        raise RuntimeError(f"vllm serve --grpc did not start:\n{self.process.tail()}")

    def frontend_cpu_s(self) -> float:
        return _cpu_seconds(self.process.pid)

    def engine_counters(self) -> EngineCounters:
        return self.process.engine_counters()

    async def stream(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        pb = self._pb
        self._ids += 1
        record = RequestRecord(start=time.monotonic())
        request = pb.GenerateRequest(
            request_id=f"g{self._ids}-{os.getpid()}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=pb.SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=1
            ),
            stream=self.stream_mode,
        )
        try:
            async for response in self._stub.Generate(request):
                kind = response.WhichOneof("response")
                tokens = (
                    response.chunk.token_ids
                    if kind == "chunk"
                    else response.complete.output_ids
                    if not self.stream_mode
                    else ()
                )
                record.got(len(tokens))
        except Exception as exc:
            record.error = repr(exc)
        record.end = time.monotonic()
        return record

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self.process.stop()


class InProcessDirectTarget:
    """vLLM's async engine-core client in the calling process (see bench.direct_worker)."""

    name = "direct"

    def __init__(self, model: str, setup: EngineSetup | None = None):
        self.model = model
        self.setup = setup or EngineSetup()
        self._engine: Any = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._ids = 0

    async def start(self) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from gateway.vllm import VllmEngine, default_engine_args

        setup = self.setup
        extra: dict[str, Any] = (
            {"distributed_executor_backend": ZERO_EXECUTOR} if setup.executor == "zero" else {}
        )
        if setup.max_num_seqs is not None:
            extra["max_num_seqs"] = setup.max_num_seqs
        args = default_engine_args(
            self.model,
            enforce_eager=not setup.cuda_graphs,
            gpu_memory_utilization=0.2,
            max_model_len=setup.max_model_len,
            **extra,
        )
        self._engine = await VllmEngine.start(args)
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            for out in await self._engine.get_output():
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def frontend_cpu_s(self) -> float:
        return _cpu_seconds(os.getpid())

    async def stream(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        from codec import Generate

        self._ids += 1
        rid = f"d{self._ids}"
        record = RequestRecord(start=time.monotonic())
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        try:
            await self._engine.add_requests(
                self._engine.prepare(rid, Generate(rid, prompt, True, sampling))
            )
            while True:
                out = await queue.get()
                record.got(len(out.new_token_ids))
                if out.finish_reason is not None:
                    break
        finally:
            del self._streams[rid]
        record.end = time.monotonic()
        return record

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._engine is not None:
            await self._engine.aclose()


class DirectTarget:
    """The direct engine-core client, the floor with no transport, in its own process.

    Frontend CPU is that driver process's (engine processes excluded), as in
    shared/ANCHORS.md; it includes its load generator, as the other targets' do not.
    """

    name = "direct"

    def __init__(self, model: str, setup: EngineSetup | None = None):
        self.model = model
        self.setup = setup or EngineSetup()
        self._proc: asyncio.subprocess.Process | None = None
        self._log_path = Path(tempfile.mkdtemp(prefix="eg-bench-")) / "direct.log"

    async def start(self) -> None:
        self._log = open(self._log_path, "w")  # noqa: SIM115 - closed in stop()
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.direct_worker",
            self.model,
            json.dumps(dataclasses.asdict(self.setup)),
            cwd=ROOT,
            env={**_env(), STEPS_DIR_ENV: str(self._log_path.parent)},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log,
            limit=64 * 1024 * 1024,
        )
        await self._result()

    def engine_counters(self) -> EngineCounters:
        assert self._proc is not None
        return read_engine_counters(self._proc.pid, self._log_path.parent)

    async def _result(self) -> dict:
        assert self._proc is not None and self._proc.stdout is not None
        while True:
            line = await self._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"direct worker exited:\n{self._log_path.read_text()[-3000:]}")
            if line.startswith(b"DIRECT_RESULT "):
                return json.loads(line[len(b"DIRECT_RESULT ") :])

    async def measure(
        self, workload: Workload, mode: str, level: float, count: int, salt: int
    ) -> tuple[RunResult, float]:
        assert self._proc is not None and self._proc.stdin is not None
        cmd = {
            "op": "run",
            "mode": mode,
            "level": level,
            "count": count,
            "salt": salt,
            "workload": {
                "prompt_len": workload.prompt_len,
                "output_len": workload.output_len,
                "seed": workload.seed,
                "vocab_size": workload.vocab_size,
            },
        }
        self._proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self._proc.stdin.drain()
        result = await self._result()
        records = [RequestRecord.from_dict(r) for r in result["records"]]
        return RunResult(records, result["wall_s"]), result["cpu_s"]

    async def stop(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.stdin.write(b'{"op": "stop"}\n')
            with contextlib.suppress(Exception):
                await self._proc.stdin.drain()
            try:
                await asyncio.wait_for(self._proc.wait(), 60)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        self._log.close()


class GatewayGroupServer:
    """`python -m gateway serve --gateway-count N`: N gateway processes on one engine."""

    def __init__(
        self,
        model: str,
        count: int,
        setup: EngineSetup | None = None,
        extra_flags: tuple[str, ...] = (),
    ):
        setup = setup or EngineSetup()
        folder = tempfile.mkdtemp(prefix="eg-")
        self.addresses = [f"ipc://{folder}/group-{i}.sock" for i in range(count)]
        self.process = _Process(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                model,
                "--gateway-count",
                str(count),
                "--bind",
                f"ipc://{folder}/group.sock",
                "--max-in-flight-per-client",
                "100000",
                "--max-in-flight-total",
                "100000",
                *extra_flags,
                *setup.flags,
            ],
            "gateway-group.log",
            env=setup.env,
        )

    def stop(self) -> None:
        self.process.stop()


class GatewayPoolTarget:
    """Several gateways (--gateway-count N) driven through the client's GatewayPool;
    frontend CPU is every gateway process's (the supervisor idles)."""

    def __init__(self, server: GatewayGroupServer, name: str):
        self.name = name
        self.server = server
        self._pool: Any = None

    async def start(self) -> None:
        from client import GatewayPool

        self._pool = GatewayPool(
            self.server.addresses, name="bench", connect_timeout_s=300, heartbeat_interval_s=5.0
        )
        try:
            await self._pool.connect()
            deadline = time.monotonic() + 60
            while len(self._pool.connected) < len(self.server.addresses):
                if time.monotonic() > deadline:
                    raise RuntimeError("not every gateway of the group answered")
                await asyncio.sleep(0.1)
        except Exception as exc:
            raise RuntimeError(
                f"gateway group did not start:\n{self.server.process.tail()}"
            ) from exc

    def frontend_cpu_s(self) -> float:
        return frontend_cpu_seconds(self.server.process.pid)

    def engine_counters(self) -> EngineCounters:
        return self.server.process.engine_counters()

    async def stream(self, prompt: list[int], max_tokens: int) -> RequestRecord:
        return await _record(self._pool.generate, prompt, max_tokens)

    async def stop(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()


# Any of these too: N data-parallel engines and/or M frontend processes.
SCALED_TARGET = re.compile(
    r"(?P<frontend>gateway|vllm-http)(?:-dp(?P<dp>\d+))?(?:-x(?P<x>\d+))?"
    r"(?:-(?P<routing>load|cache|round-robin|approximate|events))?"
)


def scaled_target(name: str) -> tuple[str, int, int] | None:
    """(frontend, data-parallel engines, frontend processes) of a -dpN / -xM target; a
    gateway's may end in -load / -cache / -round-robin (its --routing; else the default),
    -approximate or -events (``--routing cache --routing-index`` that index)."""
    match = SCALED_TARGET.fullmatch(name)
    if match is None or (match["dp"] is None and match["x"] is None):
        return None
    if match["routing"] is not None and match["frontend"] != "gateway":
        return None
    dp, x = int(match["dp"] or 1), int(match["x"] or 1)
    return (match["frontend"], dp, x) if dp >= 1 and x >= 1 and dp * x > 1 else None


def target_routing_flags(name: str) -> tuple[str, ...]:
    """The gateway flags a scaled target's -load / -cache / -round-robin / -approximate /
    -events suffix asks for."""
    match = SCALED_TARGET.fullmatch(name)
    routing = match["routing"] if match is not None else None
    if routing in ("approximate", "events"):
        return ("--routing", "cache", "--routing-index", routing)
    return ("--routing", routing) if routing is not None else ()
