"""The zero-compute executor behind a real vLLM EngineCore and the gateway: every request
gets exactly max_tokens tokens (none while its prompt is still being prefilled in chunks),
aborts work, and many streams run at once."""

from __future__ import annotations

import asyncio

import pytest

from bench.zero_engine import QUALIFIED_NAME, zero_token_id
from client import AsyncClient, FinishReason, SamplingParams
from tests.conftest import cpu_engine_args, engine_gateway

pytestmark = pytest.mark.engine

CHUNK = 64  # max_num_batched_tokens: longer prompts are prefilled over several steps


@pytest.fixture(scope="module")
async def zero_gateway():
    args = cpu_engine_args(
        distributed_executor_backend=QUALIFIED_NAME,
        max_num_batched_tokens=CHUNK,
        enable_chunked_prefill=True,
        max_num_seqs=CHUNK,
    )
    async with engine_gateway(args) as gateway:
        yield gateway


@pytest.fixture
async def client(zero_gateway):
    async with AsyncClient(zero_gateway.addresses[0], name="zero") as c:
        yield c


def test_the_token_is_never_an_eos():
    assert zero_token_id(512, {2, 3}) == 100
    assert zero_token_id(50, {49}) == 48  # below 100: the last ids that are not EOS
    assert zero_token_id(101, {100}) not in {100}
    with pytest.raises(ValueError):
        zero_token_id(2, {0, 1})


async def test_each_request_gets_exactly_max_tokens_even_with_a_chunked_prompt(client):
    eos = set(client.hello_ack.model.eos_token_ids)
    token = zero_token_id(client.hello_ack.model.vocab_size, eos)
    short = await client.complete([1, 2, 3], SamplingParams(max_tokens=20))
    assert short.token_ids == [token] * 20 and short.finish_reason is FinishReason.LENGTH
    long_prompt = list(range(4, 4 + 3 * CHUNK + 5))  # four prefill steps
    chunked = await client.complete(long_prompt, SamplingParams(max_tokens=7))
    assert chunked.token_ids == [token] * 7
    assert chunked.prompt_tokens == len(long_prompt)


async def test_many_streams_at_once_and_an_abort(client):
    sampling = SamplingParams(max_tokens=300, ignore_eos=True)
    results = await asyncio.gather(
        *(client.complete([i % 400 + 1] * 32, sampling) for i in range(200))
    )
    assert all(r.output_tokens == 300 for r in results)
    stream = client.generate([5] * 32, SamplingParams(max_tokens=100_000 // 100, ignore_eos=True))
    await anext(stream)
    ack = await client.abort([stream.request_id])
    assert ack.aborted == [stream.request_id]
