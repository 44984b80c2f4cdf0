"""Generation-config defaults, on a model whose generation_config.json sets them.

The gateway must apply the model's temperature, top_p, top_k, repetition_penalty
and max_new_tokens as vLLM's servers do, so a request that sets none of them
equals offline ``LLM.generate`` with the model's defaults. The max_tokens
default (max_new_tokens = 9, below what the context allows) is the gateway's
own computation: vLLM's engine would otherwise fill the context.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from client import AsyncClient, FinishReason, SamplingParams
from tests.conftest import TEST_MAX_MODEL_LEN, cpu_engine_args, engine_gateway
from tests.helpers import save_word_level_tokenizer, tiny_model_variant
from tests.offline_reference import run_offline_reference

pytestmark = pytest.mark.engine
GENERATION_CONFIG = dict(
    bos_token_id=1,
    eos_token_id=[2, 3],
    temperature=0.7,
    top_p=0.8,
    top_k=5,
    repetition_penalty=1.1,
    max_new_tokens=9,
)
# (name, prompt, sampling fields the request sets; everything else is the model's default)
CASES = [
    ("seeded-defaults", [5, 6, 7], dict(seed=3, ignore_eos=True)),
    ("other-seed", [9, 10], dict(seed=4, ignore_eos=True)),
    ("override-temperature", [5, 6, 7], dict(seed=3, temperature=0.0, ignore_eos=True)),
]


@pytest.fixture(scope="module")
def defaults_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("defaults") / "tiny-llama-with-defaults"
    return tiny_model_variant(path, generation_config=GENERATION_CONFIG)


@pytest.fixture(scope="module")
async def defaults_gateway(defaults_model):
    """The gateway on the model, and (``gateway.offline``) offline vLLM's outputs for CASES,
    computed while the engine starts (two cores, two starts)."""
    cases = [{"prompt": p, "sampling": s, "defaults": True} for _, p, s in CASES]
    reference = asyncio.ensure_future(
        asyncio.to_thread(run_offline_reference, str(defaults_model), TEST_MAX_MODEL_LEN, cases)
    )
    async with engine_gateway(cpu_engine_args(str(defaults_model))) as gateway:
        results = await reference
        gateway.offline = {
            name: r["samples"][0] for (name, _, _), r in zip(CASES, results, strict=True)
        }
        yield gateway


@pytest.fixture(scope="module")
def offline_defaults(defaults_gateway) -> dict[str, dict]:
    return defaults_gateway.offline


@pytest.mark.parametrize(("name", "prompt", "sampling"), CASES, ids=[c[0] for c in CASES])
async def test_model_defaults_apply_as_in_offline_vllm(
    defaults_gateway, offline_defaults, name, prompt, sampling
):
    async with AsyncClient(defaults_gateway.addresses[0]) as client:
        done = await client.complete(prompt, SamplingParams(**sampling))
    want = offline_defaults[name]
    assert done.token_ids == want["token_ids"]
    # max_new_tokens = 9 is the default cap, though 500 more tokens would fit.
    assert done.output_tokens == 9 and done.finish_reason is FinishReason.LENGTH


async def test_the_defaults_change_the_output(defaults_gateway):
    """The defaults are really applied: greedy differs from the model's sampling."""
    async with AsyncClient(defaults_gateway.addresses[0]) as client:
        sampled = [
            (await client.complete([5, 6, 7], SamplingParams(seed=s, ignore_eos=True))).token_ids
            for s in range(4)
        ]
    assert len({tuple(t) for t in sampled}) > 1


async def test_every_sample_of_n_stops_at_every_eos_id_of_the_model(defaults_gateway):
    """generation_config's eos_token_id [2, 3] stops each of n samples, as for n=1.

    vLLM's InputProcessor adds the model's EOS ids to the request's stop ids; each of
    the n samples must be made from those processed params (vLLM's ParentRequest
    copies them), not from the params before processing. allowed_token_ids=[3] makes
    the first token an EOS id.
    """
    async with AsyncClient(defaults_gateway.addresses[0]) as client:
        for n in (1, 3):
            sampling = SamplingParams(seed=5, n=n, max_tokens=6, allowed_token_ids=[3])
            samples = await client.complete_samples([5, 6, 7], sampling)
            assert len(samples) == n
            for sample in samples:
                assert sample.token_ids == [3], (n, sample)
                assert sample.finish_reason is FinishReason.STOP
                assert sample.stop_reason == 3


async def test_the_hello_ack_lists_the_eos_ids_that_stop(defaults_gateway):
    async with AsyncClient(defaults_gateway.addresses[0]) as client:
        assert client.hello_ack.model.eos_token_ids == [2, 3]


# config.json keeps eos_token_id [2, 3]; generation_config.json names none. vLLM reads the
# EOS ids from generation_config.json only, so without a tokenizer nothing stops at 2 or 3.
NO_EOS_SAMPLING = dict(seed=5, max_tokens=6, allowed_token_ids=[3])


@pytest.fixture(scope="module")
def no_eos_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("no-eos") / "tiny-llama-without-generation-eos"
    return tiny_model_variant(path, generation_config={"bos_token_id": 1})


async def test_a_generation_config_without_eos_ids_lists_none_and_stops_at_none(no_eos_model):
    """ModelInfo.eos_token_ids are exactly the ids vLLM stops on (PROTOCOL section 11):
    none here, though config.json names [2, 3]; the output equals offline vLLM's."""
    case = {"prompt": [5, 6, 7], "sampling": NO_EOS_SAMPLING, "defaults": True}
    reference = asyncio.ensure_future(
        asyncio.to_thread(run_offline_reference, str(no_eos_model), TEST_MAX_MODEL_LEN, [case])
    )
    args = cpu_engine_args(str(no_eos_model))
    async with engine_gateway(args) as gateway, AsyncClient(gateway.addresses[0]) as client:
        (offline,) = await reference
        assert client.hello_ack.model.eos_token_ids == []
        done = await client.complete([5, 6, 7], SamplingParams(**NO_EOS_SAMPLING))
    assert done.token_ids == offline["samples"][0]["token_ids"] == [3] * 6
    assert done.finish_reason is FinishReason.LENGTH
    assert offline["samples"][0]["finish_reason"] == "length"


# generation_config.json names EOS id 3; the tokenizer's own EOS token is id 2.
TOKENIZER_CASES = [("tokenizer-eos", [2]), ("generation-config-eos", [3])]


async def test_with_the_tokenizer_loaded_its_eos_stops_too_as_in_offline_vllm(tmp_path):
    """--no-skip-tokenizer-init: vLLM stops at the tokenizer's EOS id as well and reports it
    as stop_reason nil (an EOS from the generation config is reported by its id). The
    HelloAck lists both, the tokenizer's first (PROTOCOL section 11)."""
    model = tiny_model_variant(
        tmp_path / "tiny-llama-with-tokenizer",
        generation_config={"bos_token_id": 1, "eos_token_id": 3},
    )
    save_word_level_tokenizer(model, 512, eos_token_id=2)
    cases = [
        {"prompt": [5, 6, 7], "sampling": dict(seed=5, max_tokens=6, allowed_token_ids=allowed)}
        for _, allowed in TOKENIZER_CASES
    ]
    reference = asyncio.ensure_future(
        asyncio.to_thread(
            run_offline_reference, str(model), TEST_MAX_MODEL_LEN, cases, tokenizer=True
        )
    )
    args = cpu_engine_args(str(model), skip_tokenizer_init=False)
    async with engine_gateway(args) as gateway, AsyncClient(gateway.addresses[0]) as client:
        offline = await reference
        assert client.hello_ack.model.eos_token_ids == [2, 3]
        for (name, allowed), case, want in zip(TOKENIZER_CASES, cases, offline, strict=True):
            done = await client.complete(case["prompt"], SamplingParams(**case["sampling"]))
            (sample,) = want["samples"]
            assert done.token_ids == sample["token_ids"] == allowed, name
            assert done.finish_reason is FinishReason.STOP and sample["finish_reason"] == "stop"
            assert done.stop_reason == sample["stop_reason"], name
    assert [s["samples"][0]["stop_reason"] for s in offline] == [None, 3]
