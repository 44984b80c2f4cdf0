"""Structurally valid Generates with extreme values, against the real CPU engine.

Each gets an answer naming it (vLLM's refusal, or a normal stream), never
INTERNAL or ENGINE_DEAD; the gateway stays up and a bystander's greedy stream
finishes with exactly the tokens it gets alone. Once, ``n=2, seed=2**64-1``
made the engine client raise and the gateway exit for everyone.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings

from client import AsyncClient, FinishReason, RequestFailed, SamplingParams
from codec import Abort, Error, ErrorCode, Outputs, Overloaded, RequestOptions, encode
from tests.gateway.test_hardening import drain_until_pong, raw_session
from tests.strategies import hostile_generates

pytestmark = pytest.mark.engine

BIG = 2**63 - 1
HUGE = 2**64 - 1
SMALL = -(2**63)
NAN, INF = float("nan"), float("inf")

EXTREMES: dict[str, tuple[dict, dict]] = {
    "n2-seed-u64max": (dict(n=2, seed=HUGE), {}),
    "n2-seed-i64max": (dict(n=2, seed=BIG), {}),
    "n3-seed-near-max": (dict(n=3, seed=BIG - 1), {}),
    "seed-u64max": (dict(seed=HUGE), {}),
    "seed-i64min": (dict(seed=SMALL, temperature=1.0), {}),
    "temperature-nan": (dict(temperature=NAN), {}),
    "temperature-inf": (dict(temperature=INF), {}),
    "temperature-neg-inf": (dict(temperature=-INF), {}),
    "temperature-1e308": (dict(temperature=1e308), {}),
    "top_p-nan": (dict(top_p=NAN), {}),
    "top_p-inf": (dict(top_p=INF), {}),
    "top_k-i64max": (dict(top_k=BIG), {}),
    "top_k-i64min": (dict(top_k=SMALL), {}),
    "top_k-u64max": (dict(top_k=HUGE), {}),
    "min_p-nan": (dict(min_p=NAN), {}),
    "max_tokens-i64max": (dict(max_tokens=BIG), {}),
    "max_tokens-u64max": (dict(max_tokens=HUGE), {}),
    "max_tokens-i64min": (dict(max_tokens=SMALL), {}),
    "max_tokens-zero": (dict(max_tokens=0), {}),
    "min_tokens-i64max": (dict(min_tokens=BIG), {}),
    "min_tokens-negative": (dict(min_tokens=-1), {}),
    "logprobs-i64max": (dict(logprobs=BIG), {}),
    "logprobs-i64min": (dict(logprobs=SMALL), {}),
    "prompt_logprobs-u64max": (dict(prompt_logprobs=HUGE), {}),
    "presence_penalty-nan": (dict(presence_penalty=NAN), {}),
    "frequency_penalty-neg-inf": (dict(frequency_penalty=-INF), {}),
    "repetition_penalty-zero": (dict(repetition_penalty=0.0), {}),
    "repetition_penalty-inf": (dict(repetition_penalty=INF), {}),
    "logit_bias-nan": (dict(logit_bias={0: NAN}), {}),
    "logit_bias-inf": (dict(logit_bias={0: INF}), {}),
    "logit_bias-key-i64max": (dict(logit_bias={BIG: 1.0}), {}),
    "logit_bias-key-i64min": (dict(logit_bias={SMALL: 1.0}), {}),
    "logit_bias-20k": (dict(logit_bias={i: 1.0 for i in range(20_000)}), {}),
    "allowed-empty": (dict(allowed_token_ids=[]), {}),
    "allowed-int32max": (dict(allowed_token_ids=[2**31 - 1]), {}),
    "allowed-20k": (dict(allowed_token_ids=list(range(20_000))), {}),
    "allowed-i64min": (dict(allowed_token_ids=[SMALL]), {}),
    "bad_words-i64max": (dict(bad_words_token_ids=[[BIG]]), {}),
    "bad_words-empty-word": (dict(bad_words_token_ids=[[]]), {}),
    "bad_words-negative": (dict(bad_words_token_ids=[[-1]]), {}),
    "bad_words-5k": (dict(bad_words_token_ids=[[i % 500, 1] for i in range(5_000)]), {}),
    "stop-u64max": (dict(stop_token_ids=[HUGE]), {}),
    "stop-negative": (dict(stop_token_ids=[-1]), {}),
    "n-i64max": (dict(n=BIG), {}),
    "n-zero": (dict(n=0), {}),
    "n-negative": (dict(n=-1), {}),
    "priority-i64max": ({}, dict(priority=BIG)),
    "priority-i64min": ({}, dict(priority=SMALL)),
    "priority-u64max": ({}, dict(priority=HUGE)),
    "dp-rank-i64max": ({}, dict(data_parallel_rank=BIG)),
    "dp-rank-negative": ({}, dict(data_parallel_rank=-1)),
    "dp-rank-1-of-1": ({}, dict(data_parallel_rank=1)),
    "cache_salt-100k": ({}, dict(cache_salt="s" * 100_000)),
    "kv_transfer_params-nan": ({}, dict(kv_transfer_params={"x": NAN})),
    "lora-unknown": ({}, dict(lora_name="nope")),
}
# Never an answer to a client's values: those mean a gateway bug or a dead engine.
FORBIDDEN = (ErrorCode.INTERNAL, ErrorCode.ENGINE_DEAD)
BYSTANDER = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


async def _answer(client: AsyncClient, name: str, sampling: dict, options: dict) -> str:
    """Run one extreme request; return how it was answered (its stream is cut short)."""
    stream = client.generate(
        [1, 2, 3],
        SamplingParams(**sampling),
        request_id=name,
        options=RequestOptions(**options) if options else None,
    )
    try:
        async with asyncio.timeout(60):
            async for out in stream:
                assert out.request_id == name
                if out.finished is not None or out.new_token_ids:
                    return "served"
    except RequestFailed as exc:
        assert exc.request_id == name, exc
        assert exc.code.known and exc.code not in FORBIDDEN, (name, exc)
        return exc.code.name
    finally:
        await stream.aclose()
    return "served"


async def test_extreme_values_are_answered_by_name_and_a_bystander_is_intact(real_gateway):
    address = real_gateway.addresses[0]
    async with AsyncClient(address, name="bystander") as bystander:
        alone = await bystander.complete([7, 8, 9], BYSTANDER)
        running = asyncio.ensure_future(bystander.complete([7, 8, 9], BYSTANDER))
        async with AsyncClient(address, name="extremes") as client:
            answers = {}
            for name, (sampling, options) in EXTREMES.items():
                answers[name] = await _answer(client, name, sampling, options)
            health = await client.health()
        together = await running
    assert together.token_ids == alone.token_ids and len(alone.token_ids) == 200
    assert together.finish_reason is FinishReason.LENGTH
    assert health.state == "serving" and real_gateway.exit_code == 0
    # The cases that once crashed the gateway are refused with vLLM-style reasons.
    assert answers["n2-seed-u64max"] == "INVALID_REQUEST"
    assert answers["seed-u64max"] == "INVALID_REQUEST"
    assert answers["n2-seed-i64max"] == "INVALID_REQUEST"
    assert answers["n3-seed-near-max"] == "INVALID_REQUEST"
    assert answers["n-i64max"] == "INVALID_REQUEST"
    assert answers["lora-unknown"] == "UNSUPPORTED"
    assert answers["kv_transfer_params-nan"] == "UNAUTHORIZED"  # no client is allowed here


async def test_hypothesis_hostile_generates_against_the_real_engine(real_gateway):
    address = real_gateway.addresses[0]
    async with AsyncClient(address, name="bystander") as bystander:
        alone = await bystander.complete([7, 8, 9], BYSTANDER)
        running = asyncio.ensure_future(bystander.complete([7, 8, 9], BYSTANDER))
        # Blocking sockets on a thread: the gateway runs on this test's event loop.
        await asyncio.to_thread(_hostile_run, address, 60)
        together = await running
    assert together.token_ids == alone.token_ids
    assert real_gateway.exit_code == 0 and real_gateway.table.live_requests == 0


def _hostile_run(address: str, examples: int) -> None:
    sock = raw_session(address, b"hostile")
    nonces = iter(range(1, 10**9))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(hostile_generates)
    def one(msg) -> None:
        sock.send_multipart(encode(msg))
        sock.send_multipart(encode(Abort(None)))  # accepted or not, end it at once
        named = False
        for reply in drain_until_pong(sock, next(nonces)):
            if isinstance(reply, Error):
                assert reply.code.known and reply.code not in FORBIDDEN, (msg, reply)
                named |= reply.request_id == msg.request_id
            elif isinstance(reply, Overloaded):
                named |= reply.request_id == msg.request_id
            elif isinstance(reply, Outputs):
                named |= any(o.request_id == msg.request_id for o in reply.outputs)
        assert named, f"no answer named {msg.request_id!r}"

    try:
        one()
    finally:
        sock.close()
