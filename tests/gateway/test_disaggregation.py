"""Prefill/decode handoff through two gateways on two real engines that share KV blocks on
disk (vLLM's ExampleConnector): the coordinator's flow of vLLM's toy P/D proxy, over
ZeroMQ. Also: per-request timings and cached-token facts on the terminal output."""

from __future__ import annotations

import json

import pytest

from client import AsyncClient, ErrorCode, FinishReason, RequestFailed, RequestOptions
from tests.helpers import greedy

pytestmark = pytest.mark.engine
# Longer than one KV block (128 tokens on the CPU engine): the connector stores whole blocks.
PROMPT = [(i * 7) % 500 + 5 for i in range(300)]


def recorded(store, kind: str, tag: str) -> dict:
    """The params the connector inside the engine recorded for the request tagged ``tag``."""
    found = tagged(store, kind, tag)
    assert len(found) == 1, (kind, tag, found)
    return found[0]


def tagged(store, kind: str, tag: str) -> list[dict]:
    found = []
    for path in (store / "params").glob(f"{kind}-*.json"):
        params = json.loads(path.read_text())
        received = params.get("received", params) if kind == "returned" else params
        if (received or {}).get("tag") == tag:
            found.append(params)
    return found


async def test_prefill_on_one_engine_decode_on_another_equals_one_engine(pd_gateways, real_gateway):
    prefill_gw, decode_gw = pd_gateways
    store = prefill_gw.kv_store
    async with (
        AsyncClient(real_gateway.addresses[0]) as single,
        AsyncClient(prefill_gw.addresses[0]) as prefill,
        AsyncClient(decode_gw.addresses[0]) as decode,
    ):
        reference = await single.complete(PROMPT, greedy(12))
        # 1. Prefill: max_tokens=1; the engine stores the prompt's KV and returns params.
        sent_to_prefill = {"do_remote_decode": True, "tag": "pd-prefill"}
        first = await prefill.complete(
            PROMPT, greedy(1), options=RequestOptions(kv_transfer_params=sent_to_prefill)
        )
        assert first.token_ids == reference.token_ids[:1]
        assert first.finish_reason is FinishReason.LENGTH
        # The params on the terminal output are exactly what the engine's connector returned,
        # and the connector got exactly what the coordinator sent.
        returned = recorded(store, "returned", "pd-prefill")
        assert first.kv_transfer_params == returned
        assert returned["received"] == sent_to_prefill and returned["producer"] == "kv_producer"
        # 2. Decode on the other engine with the returned params.
        handoff = dict(first.kv_transfer_params, tag="pd-decode", do_remote_prefill=True)
        second = await decode.complete(
            PROMPT, greedy(12), options=RequestOptions(kv_transfer_params=handoff)
        )
        assert recorded(store, "received", "pd-decode") == handoff
        # Same tokens as one engine; the prompt's KV came from the store, not recomputed.
        assert second.token_ids == reference.token_ids
        assert second.external_cached_tokens == 256  # two whole 128-token blocks
        assert second.cached_tokens == 256
        # Without the handoff the decode engine computes everything itself.
        cold = await decode.complete([t + 1 for t in PROMPT], greedy(2))
        assert cold.external_cached_tokens == 0
    # Under the default control policy (no client allowed) the decode gateway refuses the
    # handoff by name: its params would have the connector load KV-cache blocks the client
    # names, which later serve other clients. The connector never sees them.
    from gateway.auth import ControlPolicy

    decode_gw.table.kv_transfer_allowed = ControlPolicy().allows
    try:
        async with AsyncClient(decode_gw.addresses[0]) as stranger:
            foreign = dict(handoff, tag="pd-stranger")
            with pytest.raises(RequestFailed) as refused:
                await stranger.complete(
                    PROMPT, greedy(2), options=RequestOptions(kv_transfer_params=foreign)
                )
            assert refused.value.code is ErrorCode.UNAUTHORIZED
            assert "kv_transfer_params" in refused.value.message
            assert "--control-key or --control-open" in refused.value.message
            assert tagged(store, "received", "pd-stranger") == []
            # The same client without params is served (the engine computes its prompt).
            plain = await stranger.complete([t + 2 for t in PROMPT], greedy(2))
            assert plain.external_cached_tokens == 0 and len(plain.token_ids) == 2
    finally:
        decode_gw.table.kv_transfer_allowed = decode_gw.control.allows


async def test_timings_and_cache_facts_on_the_terminal_output(real_gateway):
    async with AsyncClient(real_gateway.addresses[0]) as client:
        prompt = [(i * 3) % 400 + 7 for i in range(200)]
        first = await client.complete(prompt, greedy(8))
        again = await client.complete(prompt, greedy(8))
        for completion in (first, again):
            t = completion.timings
            assert t is not None
            assert 0 <= t.queued_s <= t.scheduled_s <= t.first_token_s <= t.finished_s
        assert first.cached_tokens == 0 and again.cached_tokens == 128  # the local prefix cache
        assert again.external_cached_tokens == 0
