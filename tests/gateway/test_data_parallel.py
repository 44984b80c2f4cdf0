"""vLLM's data parallelism behind the gateway, on the real CPU engine: two EngineCores
(one core each) behind vLLM's DP coordinator and load-balancing engine client.

Load per rank comes from HealthReply.engines (vLLM's DP coordinator counts), so these
tests see where each request runs without any hook into the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import pytest

from client import AsyncClient, ErrorCode, RequestFailed, RequestOptions, SamplingParams
from gateway.server import EXIT_ENGINE_DEAD
from gateway.tiny_model import ensure_tiny_model
from tests.conftest import (
    TEST_KV_CACHE_BYTES,
    TEST_MAX_MODEL_LEN,
    cpu_engine_args,
    engine_gateway,
)
from tests.gateway.test_lifecycle import (
    CLIENT_SCRIPT,
    UNENDING,
    long_context_args,
    wait_client_gone,
)
from tests.offline_reference import run_offline_reference
from tests.processes import ROOT

pytestmark = pytest.mark.engine

ONE_CORE_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # ANCHORS.md: DP on CPU
LONG = SamplingParams(temperature=0.0, max_tokens=TEST_MAX_MODEL_LEN - 8, ignore_eos=True)
GREEDY_CASES = [([5, 6, 7], 16), ([100, 200, 300, 400], 24)]


def pinned(rank: int) -> RequestOptions:
    return RequestOptions(data_parallel_rank=rank)


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Set ``values`` in os.environ (engine processes inherit it at start); restore after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
async def dp_gateway():
    """A gateway on two data-parallel CPU engines (one core each), with the ``cpu``
    weight-transfer backend and control calls open to every client."""
    from gateway.auth import ControlPolicy

    with environment(ONE_CORE_PER_RANK):
        context = engine_gateway(
            cpu_engine_args(data_parallel_size=2, weight_transfer_config={"backend": "cpu"}),
            control=ControlPolicy(open=True),
        )
        gateway = await context.__aenter__()
    try:
        yield gateway
    finally:
        await context.__aexit__(None, None, None)


@pytest.fixture(scope="module")
def greedy_reference() -> list[list[int]]:
    """Offline LLM.generate on GREEDY_CASES (one engine, no data parallelism)."""
    cases = [
        {"prompt": p, "sampling": dict(temperature=0.0, max_tokens=m, ignore_eos=True)}
        for p, m in GREEDY_CASES
    ]
    results = run_offline_reference(str(ensure_tiny_model()), TEST_MAX_MODEL_LEN, cases, keep=True)
    return [r["samples"][0]["token_ids"] for r in results]


@pytest.fixture
async def client(dp_gateway):
    async with AsyncClient(dp_gateway.addresses[0], name="dp") as c:
        yield c


async def wait_load(client: AsyncClient, want, timeout: float = 30.0) -> list:
    """Poll GetHealth until ``want(engines)``; returns the engines' load then."""
    engines: list = []
    try:
        async with asyncio.timeout(timeout):
            while True:
                engines = (await client.health()).engines
                if want(engines):
                    return engines
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"load never as wanted; last seen {engines}") from None


def running(engines) -> list[int]:
    return [e.running for e in engines]


async def test_health_reports_each_rank_and_pinning_places_requests(client):
    engines = await wait_load(client, lambda e: running(e) == [0, 0])
    assert [e.engine_index for e in engines] == [0, 1]
    streams = [
        asyncio.ensure_future(client.complete([9 + i], LONG, options=pinned(1))) for i in range(2)
    ]
    engines = await wait_load(client, lambda e: running(e) == [0, 2])
    assert [e.in_flight for e in engines] == [0, 2]
    assert engines[1].kv_cache_usage > 0 and engines[0].kv_cache_usage == 0
    # Unpinned requests go to the idle rank first (vLLM's balancer).
    free = asyncio.ensure_future(client.complete([3], LONG))
    await wait_load(client, lambda e: running(e) == [1, 2])
    await client.abort()
    for task in (*streams, free):
        assert (await task).finish_reason.name == "ABORT"
    await wait_load(client, lambda e: running(e) == [0, 0] and e[1].in_flight == 0)


async def test_an_abort_reaches_the_engine_that_runs_the_request(client):
    on_0 = client.generate([4], LONG, options=pinned(0), request_id="on-0")
    on_1 = client.generate([4], LONG, options=pinned(1), request_id="on-1")
    await anext(on_0)
    await anext(on_1)
    await wait_load(client, lambda e: running(e) == [1, 1])
    await client.abort(["on-1"])
    engines = await wait_load(client, lambda e: running(e) == [1, 0])
    assert [e.in_flight for e in engines] == [1, 0]
    await client.abort(["on-0"])
    await wait_load(client, lambda e: running(e) == [0, 0])
    for stream in (on_0, on_1):
        async for _ in stream:
            pass


async def test_a_killed_client_frees_both_engines(client, dp_gateway):
    address = dp_gateway.addresses[0]
    identity = f"doomed-dp-{os.getpid()}"
    # Heartbeats each 1 s (expiry after 3 s): with two busy engines on two cores the client
    # process was once starved past 0.6 s and expired before its load was seen.
    script = CLIENT_SCRIPT.format(max_tokens=LONG.max_tokens, heartbeat=1.0)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, address, identity],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == "streaming"
        # Three unpinned requests: vLLM's balancer put work on both ranks.
        await wait_load(client, lambda e: sum(running(e)) == 3 and min(running(e)) >= 1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        await wait_client_gone(dp_gateway.table, identity.encode(), timeout=10.0)
        await wait_load(client, lambda e: running(e) == [0, 0], timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_greedy_outputs_on_each_rank_equal_offline_generate(client, greedy_reference):
    for rank in (0, 1):
        for (prompt, max_tokens), expected in zip(GREEDY_CASES, greedy_reference, strict=True):
            sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            result = await client.complete(prompt, sampling, options=pinned(rank))
            assert result.token_ids == expected, f"rank {rank}, prompt {prompt}"


async def test_a_rank_out_of_range_is_refused_with_vllms_message(client):
    with pytest.raises(RequestFailed) as info:
        await client.complete([1], SamplingParams(max_tokens=1), options=pinned(2))
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert "out of range" in str(info.value)


# The kill tests' streams (UNENDING) outlive an engine group killed under them. The gateway
# sees a death within about half a second (it watches the engine processes), but on a
# starved box the test's own steps can take seconds while rank 1 streams ~900 tokens/s: a
# 2000-token stream could complete first.
# Both cores run an engine flat out there: a patient heartbeat (the default 1 s interval
# times out after 3 s of a starved process).
PATIENT = dict(connect_timeout_s=240, heartbeat_interval_s=5.0)


def doomed_dp_gateway(gateway_process, tmp_path, *extra: str):
    """A DP=2 gateway process on a 16k-context copy of the tiny model, for UNENDING."""
    return gateway_process(
        *long_context_args(tmp_path),  # overrides the test default: requests outlive the kill
        "--gpu-memory-utilization",
        "0.2",
        "--data-parallel-size",
        "2",
        *extra,
        env=ONE_CORE_PER_RANK,
    )


async def test_stats_per_rank_then_one_engine_killed_ends_every_request_and_exits_3(
    gateway_process, tmp_path
):
    """In vLLM's DP the group dies with any engine: every live request, on either rank,
    gets ENGINE_DEAD and the gateway exits 3 for its supervisor."""
    gw = doomed_dp_gateway(gateway_process, tmp_path, "--engine-stats", "--control-open")
    async with AsyncClient(gw.address, name="dp", **PATIENT) as client:
        short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        results = [await client.complete([5, 6], short, options=pinned(r)) for r in (0, 1)]
        assert results[0].token_ids == results[1].token_ids  # same weights on both ranks
        # No --routing: two ranks route by cache (the default; one gateway: approximate index).
        reply = await client.prefix_query(list(range(4, 100)))
        assert reply.routing == "cache" and len(reply.matched_tokens) == 2, reply
        # Each rank said, on its own line, that it was up (issue 72 item 3).
        for rank in (0, 1):
            assert f"engine-gateway start-up, rank {rank}: up (" in gw.output()

        loop = asyncio.get_running_loop()
        started = loop.time()

        async def doomed(rank: int, first_token: asyncio.Event) -> tuple[str, int, float]:
            """How the stream ended: the error code or finish reason, tokens, seconds."""
            tokens = 0
            try:
                async for frame in client.generate([7 + rank], UNENDING, options=pinned(rank)):
                    tokens += len(frame.new_token_ids)
                    first_token.set()
                    ending = frame.finished.finish_reason.name if frame.finished else "none"
            except RequestFailed as exc:
                ending = exc.code.name
            return ending, tokens, round(loop.time() - started, 2)

        firsts = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.ensure_future(doomed(r, firsts[i])) for i, r in enumerate((0, 1, 1))]
        # The DP coordinator's view (HealthReply) and the engines' own scheduler stats.
        engines = await wait_load(client, lambda e: running(e) == [1, 2], timeout=60)
        assert [e.in_flight for e in engines] == [1, 2]
        stats = await client.stats()
        assert [(e.engine_index, e.running) for e in stats.engines] == [(0, 1), (1, 2)]
        # On a starved box the checks above can take as long as a long stream: a fresh
        # one on rank 1, running when the kill comes, is certain to outlive the group.
        tasks.append(asyncio.ensure_future(doomed(1, firsts[3])))
        async with asyncio.timeout(60):
            await asyncio.gather(*(first.wait() for first in firsts))
        pids = await asyncio.to_thread(gw.engine_core_pids)
        assert len(pids) == 2, gw.output()[-2000:]
        os.kill(pids[0], signal.SIGKILL)
        killed_at = round(loop.time() - started, 2)
        async with asyncio.timeout(60):
            ends = await asyncio.gather(*tasks)
        seen = f"killed at {killed_at} s; streams (how, tokens, s): {ends}"
        # The killed rank's stream, and rank 1's stream started just before the kill, were
        # live at the death: ENGINE_DEAD, though the killed engine's pipes may stay open for
        # tens of seconds (its main thread's exit shows at once: process_exit.py).
        assert [ends[0][0], ends[3][0]] == ["ENGINE_DEAD", "ENGINE_DEAD"], seen
        # Rank 1's older streams: ENGINE_DEAD, or they completed before the gateway could
        # know of the death (a request that completed is not a live one); never a cut.
        for how, tokens, ended in ends[1:3]:
            completed = (how, tokens) == ("LENGTH", UNENDING.max_tokens)
            assert how == "ENGINE_DEAD" or (completed and ended < killed_at + 1), seen
    code = await asyncio.to_thread(gw.proc.wait, 60)
    assert code == EXIT_ENGINE_DEAD, gw.output()[-3000:]


async def test_a_killed_dp_coordinator_ends_every_request_with_engine_dead_and_exits_3(
    gateway_process, tmp_path
):
    """vLLM's engine client does not watch its DP coordinator (without it no rank's load
    is reported, and MoE ranks cannot keep in step); the gateway does, and treats its
    death as the engines' (as the supervisor of --gateway-count N does): the live streams
    on both ranks end with ENGINE_DEAD naming it, and the gateway exits 3."""
    gw = doomed_dp_gateway(gateway_process, tmp_path)
    async with AsyncClient(gw.address, name="dp", **PATIENT) as client:
        streams = [client.generate([7], UNENDING, options=pinned(rank)) for rank in (0, 1)]
        async with asyncio.timeout(60):  # both running
            for stream in streams:
                await anext(stream)
        coordinators = await asyncio.to_thread(gw.pids_named, "DPCoordinator")
        assert len(coordinators) == 1, gw.output()[-2000:]
        os.kill(coordinators[0], signal.SIGKILL)
        for stream in streams:
            with pytest.raises(RequestFailed) as failed:
                async with asyncio.timeout(10):  # they would complete in 20 s or more
                    async for _ in stream:
                        pass
            assert failed.value.code is ErrorCode.ENGINE_DEAD, failed.value
            assert "VLLM_DP_Coordinator (killed by SIGKILL: " in str(failed.value)
    code = await asyncio.to_thread(gw.proc.wait, 60)
    assert code == EXIT_ENGINE_DEAD, gw.output()[-3000:]
    assert "VLLM_DP_Coordinator (killed by SIGKILL: killed outright" in gw.output()


def free_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What DEPLOYMENT.md gives a headless rank for --routing cache: vLLM binds the one address
# VLLM_HOST_IP names, on free ports, and reports them to the head in its handshake.
REMOTE_KV_EVENTS = (
    '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0",'
    ' "replay_endpoint": "tcp://*:0", "topic": "kv"}'
)


async def test_two_nodes_over_loopback_a_headless_vllm_engine_and_a_gateway_head(
    gateway_process, greedy_reference, tmp_path
):
    """Multi-node DP as two "nodes" on one machine: rank 1 is `vllm serve --headless` (vLLM's
    own CLI); the gateway is the head with rank 0 (--data-parallel-size-local 1). No
    --data-parallel-start-rank on the head (it would switch on hybrid load balancing).
    The head routes by cache: rank 0's KV events come over ipc, the remote rank's over tcp
    on the address its VLLM_HOST_IP names; a prefix cached on either rank draws its
    extension there, with the hit vLLM then reports."""
    from tests.processes import Process

    rpc_port = free_tcp_port()
    dp = [
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
    ]
    headless = Process(
        [
            sys.executable,
            "-m",
            "bench.vllm_cli",
            "serve",
            str(ensure_tiny_model()),
            "--headless",
            "--data-parallel-start-rank",
            "1",
            *dp,
            "--enforce-eager",
            "--skip-tokenizer-init",
            "--gpu-memory-utilization",
            "0.2",
            "--max-model-len",
            str(TEST_MAX_MODEL_LEN),
            "--kv-cache-memory-bytes",
            str(TEST_KV_CACHE_BYTES),
            "--seed",
            "0",
            "--kv-events-config",
            REMOTE_KV_EVENTS,
        ],
        tmp_path / "headless.log",
        env={"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_HOST_IP": "127.0.0.1"},
    )
    metrics_port = free_tcp_port()
    try:
        head = gateway_process(
            *dp,
            "--seed",
            "0",
            "--routing",
            "cache",
            "--routing-index",
            "events",
            "--metrics-port",
            str(metrics_port),
            env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
        )
        async with AsyncClient(head.address, name="head", connect_timeout_s=240) as client:
            assert len(await asyncio.to_thread(head.engine_core_pids)) == 1  # rank 0 only
            headless_pids = await asyncio.to_thread(headless.engine_core_pids)
            assert len(headless_pids) == 1, headless.output()[-2000:]
            for rank in (0, 1):
                for (prompt, max_tokens), expected in zip(
                    GREEDY_CASES, greedy_reference, strict=True
                ):
                    sampling = SamplingParams(
                        temperature=0.0, max_tokens=max_tokens, ignore_eos=True
                    )
                    result = await client.complete(prompt, sampling, options=pinned(rank))
                    assert result.token_ids == expected, (rank, headless.output()[-2000:])
            await routed_by_cache_on_each_rank(client)
            scraped = await asyncio.to_thread(scrape_metrics, metrics_port)
            assert 'kv_event_feed_connected{rank="1"} 1.0' in scraped, scraped
            assert 'kv_event_rank_lag_seconds{rank="1"}' in scraped, scraped
            assert 'routing_decisions_total{reason="matched"} 2.0' in scraped, scraped
            # The remote rank streams, is seen in the load, and takes aborts.
            stream = client.generate([11], LONG, options=pinned(1))
            await anext(stream)
            await wait_load(client, lambda e: running(e) == [0, 1])
            await client.abort()
            await wait_load(client, lambda e: running(e) == [0, 0])
            await stream.aclose()
    finally:
        headless.stop()


async def routed_by_cache_on_each_rank(client: AsyncClient) -> None:
    """For each rank: a prompt pinned there, seen in the gateway's index of that rank's
    events (PrefixQuery), then its extension sent unpinned goes there by cache, and vLLM
    reports the hit the index predicted."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for rank in (0, 1):
        prefix = [(rank * 97 + i * 31) % 500 + 4 for i in range(300)]
        await client.complete(prefix, greedy, options=pinned(rank))
        extended = prefix + [9] * 100
        async with asyncio.timeout(20):
            while not (matched := (await client.prefix_query(extended)).matched_tokens)[rank]:
                await asyncio.sleep(0.05)
        assert None not in matched and matched[1 - rank] == 0, matched  # both feeds usable
        done = await client.complete(extended, greedy)
        assert done.cached_tokens == matched[rank] > 0, (rank, matched, done.cached_tokens)


def scrape_metrics(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


async def test_a_weight_update_reaches_every_rank(client):
    """Model B's tensors through the ``cpu`` backend: each rank's greedy output equals
    offline LLM.generate on B; then model A again, on both."""
    from client.weight_sync import asend_weights
    from tests.weight_trainer import checkpoint_tensors

    model_a, model_b = ensure_tiny_model(), ensure_tiny_model(weights_seed=1)
    prompt = [5, 6, 7]
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    offline_b = asyncio.ensure_future(
        asyncio.to_thread(
            run_offline_reference,
            str(model_b),
            TEST_MAX_MODEL_LEN,
            [{"prompt": prompt, "sampling": dict(temperature=0.0, max_tokens=16, ignore_eos=True)}],
            keep=True,
        )
    )
    before = [
        (await client.complete(prompt, sampling, options=pinned(r))).token_ids for r in (0, 1)
    ]
    done = await asend_weights(client, checkpoint_tensors(str(model_b)), version="dp-b")
    assert done.result["layers_updated"] == done.result["layers"] > 0
    after = [await client.complete(prompt, sampling, options=pinned(r)) for r in (0, 1)]
    ((reference,),) = [r["samples"] for r in await offline_b]
    assert [a.token_ids for a in after] == [reference["token_ids"]] * 2 != before
    assert all(a.weight_versions[0].version == "dp-b" for a in after)
    await asend_weights(client, checkpoint_tensors(str(model_a)), version="dp-a")
    assert [
        (await client.complete(prompt, sampling, options=pinned(r))).token_ids for r in (0, 1)
    ] == before


async def test_ranks_given_different_chunks_fail_the_finish_and_are_refused_until_complete(
    client,
):
    """Issue 51 item 9: a list ``update_info`` gives each rank its own chunk. Ranks that
    took different tensors must not serve under one version: the finish is refused with
    WEIGHTS_INCOMPLETE naming it, so is generation, until a complete update."""
    from client.weight_sync import asend_weights, buffer_folder, shared_memory_buckets
    from tests.weight_trainer import checkpoint_tensors

    model_a, model_b = ensure_tiny_model(), ensure_tiny_model(weights_seed=1)
    a_tensors = dict(checkpoint_tensors(str(model_a)))
    b_tensors = list(checkpoint_tensors(str(model_b)))
    # Rank 1 gets every name of B, one of them with A's bytes: the same counts, other weights.
    mixed = [(n, a_tensors[n] if n.endswith("0.mlp.down_proj.weight") else t) for n, t in b_tensors]
    assert any(n.endswith("0.mlp.down_proj.weight") for n, _ in b_tensors)
    prompt = [5, 6, 7]
    sampling = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    before = [
        (await client.complete(prompt, sampling, options=pinned(r))).token_ids for r in (0, 1)
    ]
    directory = buffer_folder(await client.init_weight_transfer_engine({}))
    await client.start_weight_update("keep")
    whole = 1 << 40  # one bucket each
    with (
        shared_memory_buckets(b_tensors, bucket_bytes=whole, directory=directory) as rank0,
        shared_memory_buckets(mixed, bucket_bytes=whole, directory=directory) as rank1,
    ):
        for info0, info1 in zip(rank0, rank1, strict=True):
            await client.update_weights([info0, info1])
        with pytest.raises(RequestFailed) as failed:
            await client.finish_weight_update("dp-mixed")
    assert failed.value.code == ErrorCode.WEIGHTS_INCOMPLETE
    assert "ranks now hold different weights" in str(failed.value)
    with pytest.raises(RequestFailed) as refused:
        await client.complete(prompt, sampling, options=pinned(1))
    assert refused.value.code == ErrorCode.WEIGHTS_INCOMPLETE
    done = await asend_weights(client, checkpoint_tensors(str(model_a)), version="dp-a")
    assert done.result["layers_updated"] == done.result["layers"] > 0
    assert [
        (await client.complete(prompt, sampling, options=pinned(r))).token_ids for r in (0, 1)
    ] == before
