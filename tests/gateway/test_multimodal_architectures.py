"""More architectures through the same path as the Idefics3 of test_multimodal.py, each with
a fixed 4 image tokens inserted before the prompt by vLLM's processor: PaliGemma (SigLIP;
Gemma; its vision tower loads on this CPU wheel only with the plugin's fix,
``client.vllm_wheel``) and BLIP-2 (a ViT and a Q-Former; OPT)."""

from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient
from client.multimodal_check import item_problem
from codec import EmbeddingRule
from tests.conftest import cpu_engine_args, engine_gateway
from tests.helpers import greedy, noise_image
from tests.offline_reference import run_offline_reference
from tests.vlm_models import (
    BLIP2_IMAGE_TOKEN,
    PALIGEMMA_IMAGE_TOKEN,
    make_tiny_blip2,
    make_tiny_paligemma,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

ENGINE = {"block_size": 32}
CASES = [([2, 50, 60], (40, 30, 1)), ([2, 50, 60], (40, 30, 2)), ([2, 51], (16, 64, 3))]
ARCHITECTURES = {
    "paligemma": (make_tiny_paligemma, PALIGEMMA_IMAGE_TOKEN),
    "blip2": (make_tiny_blip2, BLIP2_IMAGE_TOKEN),
}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
async def test_images_match_offline_vllm(tmp_path_factory, architecture):
    from client.multimodal_processor import MultimodalProcessor

    make, image_token = ARCHITECTURES[architecture]
    model = str(make(tmp_path_factory.mktemp("vlm") / f"tiny-{architecture}"))
    cases = [
        {"prompt": p, "images": [list(i)], "sampling": {"temperature": 0.0, "max_tokens": 8,
                                                        "ignore_eos": True}}
        for p, i in CASES
    ]  # fmt: skip
    reference = asyncio.ensure_future(  # beside the engine's start: two cores, two starts
        asyncio.to_thread(run_offline_reference, model, 512, cases, tokenizer=True, engine=ENGINE)
    )
    processor = MultimodalProcessor(model)
    async with engine_gateway(cpu_engine_args(model, **ENGINE)) as gateway:
        offline = [r["samples"][0]["token_ids"] for r in await reference]
        assert offline[0] != offline[1]  # the image decides the output
        schema = gateway.engine._multimodal.schemas["image"]
        assert (schema.count_key, schema.scale) == (None, 4)  # a fixed 4 embeddings
        assert schema.keys["pixel_values"].fixed == {0: 3, 1: 28, 2: 28}
        assert schema.placeholder_ids == {image_token}
        async with AsyncClient(gateway.addresses[0]) as client:
            model = client.hello_ack.model
            assert model.modalities == ["image"]
            said = model.multimodal["image"]
            assert said.tensors["pixel_values"].dims == [3, 28, 28]
            assert said.embeddings == EmbeddingRule(None, 4)
            for (prompt, image), expected in zip(CASES, offline, strict=True):
                ids, items = processor(prompt, [noise_image(*image)])
                assert ids[:4] == [image_token] * 4 and item_problem(model, ids, items[0]) is None
                tokens = []
                async for out in client.generate(ids, greedy(8), multimodal=items):
                    tokens += out.new_token_ids
                assert tokens == expected
