"""``serve --gateway-count 2``: two gateway processes on one real engine (vLLM's
client_count / client_index), driven through the client library's GatewayPool; one
gateway is killed, then the engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal

import pytest

from client import (
    ErrorCode,
    FinishReason,
    GatewayPool,
    RequestFailed,
    RequestOptions,
    SamplingParams,
    SessionLost,
)
from gateway.group import EXIT_ENGINE_DEAD
from gateway.parent_watch import STOP_GRACE_S
from tests.gateway.test_data_parallel import PATIENT, doomed_dp_gateway
from tests.gateway.test_lifecycle import UNENDING, long_context_args
from tests.helpers import gone, kill_all, stream_outcome, wait_for

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def gateway_pids(log: str) -> dict[int, int]:
    """Gateway index -> pid, from the supervisor's log lines."""
    return {int(i): int(pid) for i, pid in re.findall(r"gateway (\d+) \(pid (\d+)\)", log)}


def group_addresses(supervisor, count: int = 2) -> list[str]:
    """The addresses of a ``--gateway-count`` supervisor's gateways (ipc: NAME-i.sock)."""
    base = supervisor.address.removesuffix(".sock")
    return [f"{base}-{i}.sock" for i in range(count)]


@contextlib.asynccontextmanager
async def pool_on(addresses: list[str]):
    """A GatewayPool once every gateway has a session; a patient heartbeat: a starved box is
    slow to answer (its pauses are forgiven)."""
    async with GatewayPool(
        addresses, connect_timeout_s=240, heartbeat_interval_s=2.0, reconnect_timeout_s=10
    ) as pool:
        async with asyncio.timeout(120):
            while len(pool.connected) < len(addresses):
                await asyncio.sleep(0.05)
        yield pool


async def started(pool: GatewayPool, prompt: list[int]):
    """A stream past its first output that outlives everything below (a 16k-context model:
    on a starved box a 2000-token stream could finish before the kill it waits for)."""
    stream = pool.generate(prompt, UNENDING)
    await anext(stream)
    return stream


async def test_two_gateways_share_one_engine_and_the_pool_fails_over(gateway_process, tmp_path):
    from tests.lora_adapter import make_tiny_lora

    args = long_context_args(tmp_path)
    supervisor = gateway_process(
        *args,
        "--gateway-count",
        "2",
        "--enable-lora",
        "--control-open",
        "--weight-transfer-config",
        '{"backend": "cpu"}',
    )
    addresses = group_addresses(supervisor)
    async with pool_on(addresses) as pool:
        # Both gateways serve the same engine: same greedy tokens through either one.
        results = [await client.complete([7, 8, 9], GREEDY) for client in pool.clients]
        assert results[0].token_ids == results[1].token_ids
        # The supervisor says the group serves once both gateways do (issue 72 item 3).
        async with asyncio.timeout(10):
            while "serving: all 2 gateways of the group" not in supervisor.output():
                await asyncio.sleep(0.1)
        # ... and each gateway says how it serves, in its own line.
        assert supervisor.output().count("; control calls: open to every client;") == 2
        # Each gateway loads its own adapter under the same name: vLLM tells them apart
        # (their LoRA ids differ; with equal ids gateway 1 got gateway 0's adapter).
        mine = RequestOptions(lora_name="mine")
        for i, client in enumerate(pool.clients):
            await client.load_lora("mine", str(make_tiny_lora(tmp_path / f"lora-{i}", seed=i)))
        tuned = [
            (await c.complete([7, 8, 9], GREEDY, options=mine)).token_ids for c in pool.clients
        ]
        assert tuned[0] != tuned[1] and results[0].token_ids not in tuned
        # A weight update through gateway 0 (the model's own tensors, named "v2"): gateway 1
        # serves it, under that version, and both adapters still serve their own weights.
        from client.weight_sync import asend_weights
        from tests.weight_trainer import checkpoint_tensors

        tensors = checkpoint_tensors(args[0])
        done = await asend_weights(pool.clients[0], tensors, version="v2")
        assert done.result["layers_updated"] == done.result["layers"] > 0
        seen = await pool.clients[1].complete([7, 8, 9], GREEDY)
        assert seen.token_ids == results[1].token_ids
        assert [s.version for s in seen.weight_versions] == ["v2"]
        assert [
            (await c.complete([7, 8, 9], GREEDY, options=mine)).token_ids for c in pool.clients
        ] == tuned
        # An update open through gateway 0 holds generation for the whole group: gateway 1,
        # which knows nothing of it, may neither resume the engine (it would step on
        # half-loaded layers) nor reload weights into it (issue 48 item 3).
        await pool.clients[0].init_weight_transfer_engine({})
        await pool.clients[0].start_weight_update("keep")
        for call in (pool.clients[1].resume(), pool.clients[1].reload_weights(args[0])):
            with pytest.raises(RequestFailed) as refused:
                await call
            assert refused.value.code is ErrorCode.INVALID_REQUEST
            assert "a weight update is open on this engine" in str(refused.value)
        await pool.clients[0].abandon_weight_update()
        await pool.clients[1].resume()  # nothing open now: allowed (the engine runs anyway)
        assert (await pool.clients[1].complete([7, 8, 9], GREEDY)).token_ids == results[1].token_ids
        streams = [pool.generate([3 + i], UNENDING) for i in range(4)]
        for stream in streams:
            await anext(stream)
        assert sorted(pool.in_flight().values()) == [2, 2]
        health = await pool.health()
        assert [h.live_requests for h in health.values()] == [2, 2]
        # Gateway 1 dies: its requests fail retryably, the pool carries on with gateway 0.
        pids = gateway_pids(supervisor.output())
        assert sorted(pids) == [0, 1], supervisor.output()[-2000:]
        os.kill(pids[1], signal.SIGKILL)
        lost = [s for s in streams if s.gateway == addresses[1]]
        for error in await asyncio.gather(*(stream_outcome(s) for s in lost)):
            assert isinstance(error, SessionLost) and error.retryable
        async with asyncio.timeout(30):
            while pool.connected != [addresses[0]]:
                await asyncio.sleep(0.05)
        retried = await pool.complete([7, 8, 9], GREEDY)
        assert retried.token_ids == results[0].token_ids
        assert supervisor.proc.poll() is None  # the other gateway keeps serving
        # Then the engine dies: the supervisor tells gateway 0, whose live requests end
        # with ENGINE_DEAD, and exits 3 for its own supervisor.
        kept = [await started(pool, [20 + i]) for i in range(2)]
        assert {s.gateway for s in kept} == {addresses[0]}
        engine_pids = await asyncio.to_thread(supervisor.engine_core_pids)
        assert len(engine_pids) == 1, supervisor.output()[-2000:]
        os.kill(engine_pids[0], signal.SIGKILL)
        for error in await asyncio.gather(*(stream_outcome(s) for s in kept)):
            assert isinstance(error, RequestFailed) and error.code is ErrorCode.ENGINE_DEAD
            assert "supervisor saw an engine process exit" in str(error)
        for stream in streams:
            await stream_outcome(stream)
    code = await asyncio.to_thread(supervisor.proc.wait, 60)
    assert code == EXIT_ENGINE_DEAD, supervisor.output()[-3000:]


async def test_two_gateways_route_by_cache_then_a_sigkilled_supervisor_leaves_nothing(
    gateway_process, tmp_path
):
    """Two gateways on two data-parallel engines with ``--routing cache``: each keeps its
    own index of both ranks' KV events, the same one (a prefix sent through either gateway
    is seen by both), so their choices agree: an extension sent through the other gateway,
    or through ``GatewayPool(policy="cache")``, goes to the rank holding the prefix and
    vLLM reports the hit predicted. Then the supervisor is SIGKILLed: the engines and
    vLLM's DP coordinator stop by themselves (the engine-gateway vLLM plugin), each gateway
    ends its live requests and exits 3, as if the supervisor had seen the engines die.
    Before, all of them lived on, orphaned."""
    supervisor = doomed_dp_gateway(
        gateway_process, tmp_path, "--gateway-count", "2", "--routing", "cache"
    )
    base = supervisor.address.removesuffix(".sock")
    addresses = [f"{base}-0.sock", f"{base}-1.sock"]
    async with GatewayPool(addresses, policy="cache", reconnect_timeout_s=1, **PATIENT) as pool:
        async with asyncio.timeout(120):
            while len(pool.connected) < 2:
                await asyncio.sleep(0.05)
        await both_gateways_route_by_the_same_cache(pool)
        streams = [pool.generate([3 + i], UNENDING) for i in range(4)]
        for stream in streams:
            await anext(stream)
        assert sorted(pool.in_flight().values()) == [2, 2]
        # Off the event loop: a process's cmdline is read under its memory lock, which an
        # engine's teardown or the VM's reclaim can hold for seconds (process_exit.py), and
        # a loop held past the 15 s heartbeat timeout expired these very sessions.
        family = await asyncio.to_thread(
            lambda: {p.pid: " ".join(p.cmdline()) for p in supervisor.descendants()}
        )
        kinds = [
            "DPCoordinator",
            "EngineCore_DP0",
            "EngineCore_DP1",
            *gateway_pids(supervisor.output()).values(),
        ]
        for kind in kinds:
            assert any(str(kind) in f"{pid} {line}" for pid, line in family.items()), kind
        try:
            supervisor.proc.kill()
            supervisor.proc.wait()
            # The engines abort their requests as they stop (finish ABORT), or the gateway
            # got its SIGUSR1 first (ENGINE_DEAD); either way one terminal, at once.
            async with asyncio.timeout(30):
                outcomes = await asyncio.gather(*(ending(s) for s in streams))
            for outcome in outcomes:
                if isinstance(outcome, SessionLost):
                    # This test's own process stalled past the heartbeat timeout (seen in CI:
                    # 16 s on the 2-core box) and the session expired first: one terminal
                    # all the same, and retryable.
                    assert "session expired" in str(outcome), outcome
                elif isinstance(outcome, RequestFailed):
                    assert outcome.code is ErrorCode.ENGINE_DEAD, outcome
                    assert "supervisor (pid" in str(outcome) and "was killed" in str(outcome)
                else:
                    assert outcome is FinishReason.ABORT, outcome
            took = await asyncio.to_thread(wait_for, lambda: all(map(gone, family)), 60)
        finally:
            kill_all(list(family))
    assert took < STOP_GRACE_S + 10, took  # a stuck shutdown is SIGKILLed after the grace
    log = supervisor.output()
    # The coordinator and engines (SIGTERM; a process that ended by another path first
    # logs nothing, but none did here) and both gateways, which know of nothing else.
    assert log.count("is gone: stopping (SIGTERM") >= 1, log[-3000:]
    assert log.count("is gone: stopping (SIGUSR1") == 2, log[-3000:]


async def both_gateways_route_by_the_same_cache(pool: GatewayPool) -> None:
    """Prefixes sent through one gateway; their extensions through the other, then through
    the pool: each lands where the prefix is cached, with the hit both indexes predicted."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first, second = pool.clients
    holders = set()
    for turn in range(4):
        prefix = [(turn * 53 + i * 29) % 500 + 4 for i in range(300)]
        await (first if turn % 2 == 0 else second).complete(prefix, greedy)
        extended = prefix + [9] * 100
        async with asyncio.timeout(20):
            while True:
                seen = [(await c.prefix_query(extended)).matched_tokens for c in pool.clients]
                if seen[0] == seen[1] and any(seen[0]):
                    break
                await asyncio.sleep(0.05)
        matched = seen[0]
        (rank,) = [r for r, tokens in enumerate(matched) if tokens]
        holders.add(rank)
        other = second if turn % 2 == 0 else first
        done = await other.complete(extended, greedy)
        assert done.cached_tokens == matched[rank], (turn, matched, done.cached_tokens)
        longer = extended + [10] * 40
        assert (await pool.complete(longer, greedy)).cached_tokens >= matched[rank]
    assert holders == {0, 1}  # fresh prefixes went by load: both ranks served


async def ending(stream) -> FinishReason | RequestFailed | SessionLost | None:
    """How a stream ended: its finish reason, or the error it failed with."""
    reason = None
    try:
        async for out in stream:
            if out.finished:
                reason = out.finished.finish_reason
    except (RequestFailed, SessionLost) as exc:
        return exc
    return reason


async def test_a_gateway_that_exits_3_takes_the_group_with_it(gateway_process, tmp_path):
    """One gateway finds the engines dead (here: told so directly, SIGUSR1) and exits 3:
    the supervisor fans that out, so the other gateway ends its requests with ENGINE_DEAD
    too and every process exits 3, rather than serving on beside engines deemed dead."""
    supervisor = gateway_process(
        *long_context_args(tmp_path), "--gateway-count", "2", "--control-open"
    )
    addresses = group_addresses(supervisor)
    async with pool_on(addresses) as pool:
        streams = [await started(pool, [3 + i]) for i in range(4)]
        assert {s.gateway for s in streams} == set(addresses)
        family = [p.pid for p in supervisor.descendants()]
        pids = gateway_pids(supervisor.output())
        try:
            # Held in the engine (Pause keep), no stream can end on its own before the
            # fan-out reaches it, however slow a starved box makes the group's exit.
            await pool.clients[0].pause("keep")
            os.kill(pids[1], signal.SIGUSR1)
            for stream in streams:
                error = await stream_outcome(stream)
                assert isinstance(error, RequestFailed), error
                assert error.code is ErrorCode.ENGINE_DEAD
            code = await asyncio.to_thread(supervisor.proc.wait, 60)
            assert code == EXIT_ENGINE_DEAD, supervisor.output()[-3000:]
            await asyncio.to_thread(wait_for, lambda: all(map(gone, family)), 60)
        finally:
            kill_all(family)
