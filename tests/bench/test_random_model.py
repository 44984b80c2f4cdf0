"""Random-weight checkpoints of real shapes: the published parameter counts, a complete
checkpoint that transformers and vLLM load, and the gateway on a Llama-3 vocabulary (128,256
ids, three EOS ids) equal to offline vLLM."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench import random_model
from bench.random_model import GENERATION_CONFIGS, SHAPES, parameter_shapes, write_random_model
from client import AsyncClient, ErrorCode, FinishReason, RequestFailed, SamplingParams
from tests.conftest import TEST_MAX_MODEL_LEN, cpu_engine_args, engine_gateway
from tests.offline_reference import run_offline_reference

LLAMA3_EOS = [128001, 128008, 128009]
# Llama 3.2 1B's vocabulary, EOS ids, RoPE scaling and sampling defaults on a tiny body.
SMALL_LLAMA3 = dict(
    SHAPES["llama-3.2-1b"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


@pytest.mark.parametrize(
    ("shape", "billions"), [("llama-3.2-1b", 1.24), ("llama-3.2-3b", 3.21), ("llama-3.1-8b", 8.03)]
)
def test_published_shapes_have_their_parameter_counts(shape, billions):
    total = sum(_numel(s) for s in parameter_shapes(SHAPES[shape]).values())
    assert round(total / 1e9, 2) == billions


def test_a_checkpoint_is_complete_sharded_and_seeded(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(random_model, "_SHARD_BYTES", 4 * 1024**2)  # force several shards
    total = write_random_model(tmp_path / "a", SMALL_LLAMA3, GENERATION_CONFIGS["llama-3.2-1b"])
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(parameter_shapes(SMALL_LLAMA3))
    assert total == sum(_numel(s) for s in parameter_shapes(SMALL_LLAMA3).values())

    model, info = LlamaForCausalLM.from_pretrained(tmp_path / "a", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.vocab_size == 128256 and model.config.eos_token_id == LLAMA3_EOS

    write_random_model(tmp_path / "b", SMALL_LLAMA3, GENERATION_CONFIGS["llama-3.2-1b"])
    write_random_model(tmp_path / "c", SMALL_LLAMA3, GENERATION_CONFIGS["llama-3.2-1b"], seed=1)
    name = "model.embed_tokens.weight"
    file = index["weight_map"][name]
    a, b, c = (load_file(tmp_path / d / file)[name] for d in "abc")
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_the_command_refuses_to_overwrite_a_model(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert random_model.main(["llama-3.2-1b", str(tmp_path)]) == 2
    assert "already holds a model" in capsys.readouterr().err


@pytest.fixture(scope="module")
def llama3_vocab_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3-vocab")
    write_random_model(folder, SMALL_LLAMA3, GENERATION_CONFIGS["llama-3.2-1b"], seed=3)
    return folder


CASES = [  # ids above 65,535 on the wire both ways; model defaults (temperature 0.6, top_p 0.9)
    ("greedy", [128000, 9906, 128255, 70000], dict(temperature=0.0, max_tokens=12)),
    ("seeded defaults", [128000, 40, 1093], dict(seed=11, max_tokens=12)),
    ("high-id EOS", [128000, 5], dict(seed=2, max_tokens=6, allowed_token_ids=[128009])),
]


@pytest.mark.engine
async def test_the_gateway_on_a_llama3_vocabulary_equals_offline_vllm(llama3_vocab_model):
    cases = [{"prompt": p, "sampling": s, "defaults": True} for _, p, s in CASES]
    reference = asyncio.ensure_future(  # beside the engine's start: two cores, two starts
        asyncio.to_thread(run_offline_reference, str(llama3_vocab_model), TEST_MAX_MODEL_LEN, cases)
    )
    args = cpu_engine_args(str(llama3_vocab_model))
    async with engine_gateway(args) as gateway, AsyncClient(gateway.addresses[0]) as client:
        offline = await reference
        model = client.hello_ack.model
        assert (model.vocab_size, model.eos_token_ids) == (128256, LLAMA3_EOS)
        for (name, prompt, sampling), want in zip(CASES, offline, strict=True):
            done = await client.complete(prompt, SamplingParams(**sampling))
            (sample,) = want["samples"]
            assert done.token_ids == sample["token_ids"], name
            assert done.finish_reason.name.lower() == sample["finish_reason"], name
            assert done.stop_reason == sample["stop_reason"], name
        assert done.finish_reason is FinishReason.STOP and done.token_ids == [128009]
        with pytest.raises(RequestFailed) as refused:
            await client.complete([128000, 128256], SamplingParams(max_tokens=2))
        assert refused.value.code is ErrorCode.INVALID_REQUEST
        assert "128256 is out of vocabulary" in str(refused.value)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out
