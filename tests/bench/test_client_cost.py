"""bench.probes.client_cost: every stream is read to its end and the CPU figures are reported
(fake engine; no timing assertions), on any model's vocabulary."""

from __future__ import annotations

import os

from bench.probes.client_cost import measure_client_cost
from client import AsyncClient
from gateway.engine import EngineInfo
from gateway.fake_engine import FakeEngine
from tests.conftest import running_gateway


async def test_every_token_of_every_stream_is_counted_with_both_cpu_figures():
    small_vocab = EngineInfo("fake", 1024, 16, (2,), 20, 256)  # 20 prompts: ids 0..19 drawn
    async with (
        running_gateway(FakeEngine(info=small_vocab)) as gateway,
        AsyncClient(gateway.addresses[0]) as client,
    ):
        cost = await measure_client_cost(
            client, concurrency=6, requests=20, output_len=7, gateway_pid=os.getpid()
        )
        assert gateway.table.live_requests == 0
    assert cost.tokens == 20 * 7
    assert cost.wall_s > 0 and cost.client_cpu_s > 0
    assert cost.gateway_cpu_s is not None and cost.gateway_cpu_s >= 0
    assert "c=6: 140 tokens" in cost.summary(6)
