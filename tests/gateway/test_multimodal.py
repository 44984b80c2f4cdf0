"""Multimodal items on the real CPU engine: a tiny random Idefics3 (SmolVLM's architecture),
its items made by vLLM's own processor in the client (``client.multimodal_processor``),
greedy outputs equal to offline ``LLM.generate`` with the same images, items sent by hash
alone, and every malformed item refused by name while another request streams on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from client import AsyncClient, RequestFailed
from client.multimodal_check import item_problem
from codec import (
    VERSION_FRAME,
    EmbeddingRule,
    Error,
    ErrorCode,
    Generate,
    Hello,
    MultimodalItem,
    SamplingParams,
    Tensor,
    TensorSchema,
    decode_server,
    encode_payload,
)
from gateway.tiny_model import TINY_VLM_IMAGE_TOKEN, ensure_tiny_vlm
from tests.conftest import cpu_engine_args, engine_gateway
from tests.helpers import greedy, noise_image
from tests.offline_reference import run_offline_reference

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

IMG = TINY_VLM_IMAGE_TOKEN
MAX_LEN = 512
ENGINE = {"limit_mm_per_prompt": {"image": 4}, "block_size": 32}
# (width, height, seed): aspect ratios that cut into 2x2, 1x2 and 2x1 tiles (+ global).
A, B, C = (56, 40, 1), (56, 20, 2), (24, 56, 3)
B2 = (56, 20, 4)  # B's size, other pixels
CASES = [
    ([50, IMG, 60, 70], [A]),
    ([50, IMG, 60, 70], [B]),
    ([50, IMG, 61, IMG, 71], [A, C]),
    ([52, IMG, 62, IMG, 72], [B, B]),  # one image twice in a prompt
    ([53, 54, IMG, 63], [C]),
    ([55, IMG, 64, IMG, 73], [B, B2]),
]


@pytest.fixture(scope="module")
def vlm_path() -> str:
    return str(ensure_tiny_vlm())


@pytest.fixture(scope="module")
def offline(vlm_gateway):
    return vlm_gateway.offline


def _greedy_dict() -> dict:
    return {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def processor(vlm_path):
    from client.multimodal_processor import MultimodalProcessor

    return MultimodalProcessor(vlm_path)


@pytest.fixture(scope="module")
async def vlm_gateway(vlm_path):
    from gateway.auth import ControlPolicy

    cases = [
        {"prompt": prompt, "images": [list(i) for i in images], "sampling": _greedy_dict()}
        for prompt, images in CASES
    ]
    reference = asyncio.ensure_future(  # offline vLLM's outputs, while the engine starts
        asyncio.to_thread(
            run_offline_reference, vlm_path, MAX_LEN, cases, tokenizer=True, engine=ENGINE
        )
    )
    args = cpu_engine_args(vlm_path, **ENGINE)
    async with engine_gateway(args, control=ControlPolicy(open=True)) as gateway:
        gateway.offline = [r["samples"][0]["token_ids"] for r in await reference]
        yield gateway


async def _tokens(client: AsyncClient, prompt, items, max_tokens: int = 8) -> list[int]:
    tokens: list[int] = []
    async for out in client.generate(prompt, greedy(max_tokens), multimodal=items):
        tokens += out.new_token_ids
    return tokens


def _processed(processor, case):
    prompt, images = case
    return processor(prompt, [noise_image(*i) for i in images])


async def test_images_match_offline_vllm(vlm_gateway, processor, offline):
    # The images must matter, or equal outputs would prove nothing.
    assert offline[0] != offline[1]
    # What the probe of vLLM's processor learnt: 4 embeddings per tile, tiles = num_patches.
    schema = vlm_gateway.engine._multimodal.schemas["image"]
    assert (schema.count_key, schema.scale, schema.placeholder_ids) == ("num_patches", 4, {IMG})
    assert schema.keys["pixel_values"].follows == {0: "num_patches"}
    assert schema.keys["pixel_values"].fixed == {1: 3, 2: 56, 3: 56}
    async with AsyncClient(vlm_gateway.addresses[0]) as client:
        model = client.hello_ack.model
        assert model.modalities == ["image"]
        assert client.hello_ack.limits.max_multimodal_items == 16
        # ... and what HelloAck tells clients of it.
        said = model.multimodal["image"]
        assert said.tensors["pixel_values"].dims == ["num_patches", 3, 56, 56]
        # Idefics3's normalisation makes [-1, 1] (learnt from black, white and noise probes).
        assert said.tensors["pixel_values"].value_range == [-3, 3]
        assert said.tensors["num_patches"] == TensorSchema("int64", [], [None], [1])
        assert (said.embeddings, said.placeholder_tokens) == (
            EmbeddingRule("num_patches", 4),
            [IMG],
        )
        for case, expected in zip(CASES, offline, strict=True):
            prompt, items = _processed(processor, case)
            assert len(items) == len(case[1])
            assert [item_problem(model, prompt, i) for i in items] == [None] * len(items)
            assert sum(t == IMG for t in prompt) == sum(i.is_embed.count(True) for i in items)
            assert await _tokens(client, prompt, items) == expected, case


async def test_a_repeated_image_goes_by_hash_alone(vlm_gateway, processor, offline):
    async with AsyncClient(vlm_gateway.addresses[0]) as client:
        before = (await client.stats()).gateway
        prompt, items = _processed(processor, CASES[0])
        assert await _tokens(client, prompt, items) == offline[0]
        # Another prompt with the same image: its tensors stay home, the engine finds the
        # image's encoder output cached (the first block differs, so no prefix-cache hit).
        other = [51, *prompt[1:]]
        tokens_by_hash = await _tokens(client, other, items)
        after = (await client.stats()).gateway
        assert after["multimodal_items_by_hash"] == before["multimodal_items_by_hash"] + 1
        assert after["encoder_cache_hits"] > before["encoder_cache_hits"]
        # Same tokens as with the tensors resent, in a new session (which holds none).
    async with AsyncClient(vlm_gateway.addresses[0]) as fresh:
        assert await _tokens(fresh, other, items) == tokens_by_hash
        assert (await fresh.stats()).gateway["multimodal_items_by_hash"] == after[
            "multimodal_items_by_hash"
        ]


async def test_an_unknown_hash_is_refused_and_the_client_resends(vlm_gateway, processor, offline):
    prompt, items = _processed(processor, CASES[1])
    async with AsyncClient(vlm_gateway.addresses[0]) as client:
        # The client believes the gateway holds the item (as after an eviction).
        client._multimodal_sent.add(items[0].hash)
        assert await _tokens(client, prompt, items) == offline[1]
        assert client.multimodal_resends == 1
        stats = (await client.stats()).gateway
        assert stats["multimodal_unknown_hashes"] >= 1


def _raw_generate(address: str, message: Generate) -> Error:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart([VERSION_FRAME, encode_payload(Hello(1, "raw"))])
        assert sock.poll(10_000)
        sock.recv_multipart()
        sock.send_multipart([VERSION_FRAME, encode_payload(message)])
        assert sock.poll(10_000)
        return decode_server(sock.recv_multipart())
    finally:
        sock.close()


async def test_a_hash_only_item_never_sent_is_named(vlm_gateway, processor):
    prompt, items = _processed(processor, CASES[0])
    bare = msgspec.structs.replace(items[0], tensors=None, hash="never-sent")
    reply = await asyncio.to_thread(
        _raw_generate, vlm_gateway.addresses[0], Generate("q1", prompt, multimodal=[bare])
    )
    assert isinstance(reply, Error) and reply.request_id == "q1"
    assert reply.code is ErrorCode.MULTIMODAL_ITEM_UNKNOWN
    assert "multimodal[0] (hash 'never-sent')" in reply.message


def _with_value(tensor: Tensor, value: float) -> Tensor:
    """``tensor`` with its first element set to ``value`` (in its own dtype)."""
    import torch

    values = torch.frombuffer(bytearray(tensor.data), dtype=getattr(torch, tensor.dtype))
    values[0] = value
    return msgspec.structs.replace(tensor, data=values.view(torch.uint8).numpy().tobytes())


def _bad_items(prompt: list[int], item: MultimodalItem):
    """(name, prompt, items, expected code, words the message must hold)."""
    t = item.tensors
    pv = t["pixel_values"]
    rep = msgspec.structs.replace
    n = t["num_patches"]
    one_patch = Tensor(pv.dtype, [1, *pv.shape[1:]], pv.data[: len(pv.data) // pv.shape[0]])
    invalid = ErrorCode.INVALID_REQUEST
    tile = len(pv.data) // pv.shape[0]  # bytes of one tile
    zero_tile = msgspec.structs.replace(
        pv, data=bytes(pv.data[:tile]) + bytes(tile) + bytes(pv.data[2 * tile :])
    )
    minus_zero = b"\x00\x80" if pv.dtype in ("bfloat16", "float16") else b"\x00\x00\x00\x80"
    minus_zero_tile = msgspec.structs.replace(
        pv,
        data=bytes(pv.data[:tile])
        + minus_zero * (tile // len(minus_zero))
        + bytes(pv.data[2 * tile :]),
    )
    end = item.offset + item.length
    doubled = [*prompt[:end], *prompt[item.offset : end], *prompt[end:]]  # the range twice
    five = [*prompt[:end], *prompt[item.offset : end] * 4, *prompt[end:]]  # ENGINE allows 4
    one_less = list(item.is_embed)
    one_less[one_less.index(True)] = False
    return [
        ("modality", prompt, [rep(item, modality="audio")], ErrorCode.UNSUPPORTED, ["audio"]),
        ("missing tensor", prompt, [rep(item, tensors={"pixel_values": pv})], invalid,
         ["missing", "num_patches"]),
        ("unknown tensor", prompt, [rep(item, tensors={**t, "extra": n})], invalid,
         ["unknown", "extra"]),
        ("int dtype", prompt,
         [rep(item, tensors={**t, "num_patches": Tensor("float32", [], bytes(4))})], invalid,
         ["num_patches", "float32", "integer"]),
        ("float dtype", prompt,
         [rep(item, tensors={**t, "pixel_values": rep(pv, dtype="int16")})], invalid,
         ["pixel_values", "int16", "floating"]),
        ("unknown dtype", prompt,
         [rep(item, tensors={**t, "pixel_values": rep(pv, dtype="complex64")})], invalid,
         ["complex64"]),
        ("bytes for shape", prompt,
         [rep(item, tensors={**t, "pixel_values": rep(pv, data=pv.data[:-2])})], invalid,
         ["pixel_values", "bytes"]),
        ("fixed dim", prompt,
         [rep(item, tensors={**t, "pixel_values": Tensor(pv.dtype, [pv.shape[0], 3, 28, 112],
                                                          pv.data)})], invalid,
         ["pixel_values", "dim 2 must be 56"]),
        ("count", prompt, [rep(item, tensors={**t, "pixel_values": one_patch})], invalid,
         ["dim 0", "num_patches"]),
        ("embeddings", prompt, [rep(item, is_embed=one_less)], invalid, ["embeddings"]),
        ("placeholder token", [*prompt[:-1], 9], [rep(item, is_embed=None,
                                                     length=len(prompt) - item.offset)],
         invalid, ["embeddings"]),
        ("not a placeholder", [p if p != IMG else 9 for p in prompt], [item], invalid,
         ["placeholder token"]),
        ("past the prompt", prompt[: item.offset + 3], [item], invalid, ["past the prompt"]),
        ("is_embed length", prompt, [rep(item, is_embed=[True])], invalid, ["is_embed"]),
        ("overlap", prompt, [item, item], invalid, ["multimodal[1]", "overlaps"]),
        ("zero tile", prompt, [rep(item, tensors={**t, "pixel_values": zero_tile})], invalid,
         ["pixel_values'][1]", "all zeros"]),
        ("negative zero tile", prompt,
         [rep(item, tensors={**t, "pixel_values": minus_zero_tile})], invalid,
         ["pixel_values'][1]", "all zeros"]),
        # NaN, or a value that overflows inside the model, would stay in KV-cache blocks
        # that vLLM hands to other clients' later requests.
        ("NaN pixel", prompt,
         [rep(item, tensors={**t, "pixel_values": _with_value(pv, float("nan"))})], invalid,
         ["pixel_values", "holds NaN", "[-3, 3]"]),
        ("infinite pixel", prompt,
         [rep(item, tensors={**t, "pixel_values": _with_value(pv, float("-inf"))})], invalid,
         ["pixel_values", "values from -inf", "[-3, 3]"]),
        ("huge pixel", prompt,
         [rep(item, tensors={**t, "pixel_values": _with_value(pv, 1e30)})], invalid,
         ["pixel_values", "values from", "[-3, 3]"]),
        ("mask off its placeholders", doubled,
         [rep(item, length=2 * item.length, is_embed=[False] * item.length + item.is_embed)],
         invalid, ["is_embed leaves it out"]),
        ("too many", prompt, [item] * 17, invalid, ["max_multimodal_items"]),
        ("over the engine's per-prompt limit", five,
         [rep(item, offset=item.offset + k * item.length) for k in range(5)], invalid,
         ["5 image items", "at most 4 per prompt"]),
    ]  # fmt: skip


async def test_bad_items_are_refused_by_name_while_another_streams(vlm_gateway, processor):
    prompt, items = _processed(processor, CASES[0])
    async with AsyncClient(vlm_gateway.addresses[0]) as client:
        bystander_tokens = 0
        stream = client.generate([60, 61, 62], SamplingParams(temperature=0, max_tokens=300,
                                                              ignore_eos=True))  # fmt: skip
        first = await stream.__anext__()
        bystander_tokens += len(first.new_token_ids)
        for name, bad_prompt, bad_items, code, words in _bad_items(prompt, items[0]):
            if len(bad_items) == 1:  # the client's own check sees it too
                assert item_problem(client.hello_ack.model, bad_prompt, bad_items[0]), name
            try:
                await _tokens(client, bad_prompt, bad_items)
            except RequestFailed as exc:
                caught = exc
            else:
                pytest.fail(f"{name}: accepted")
            assert caught.code is code, (name, caught)
            for word in ["multimodal", *words]:
                assert word in str(caught), (name, word, str(caught))
        finish = None
        async for out in stream:
            bystander_tokens += len(out.new_token_ids)
            finish = out.finished
        assert finish is not None and bystander_tokens == 300
        # The gateway and engine still serve images.
        assert len(await _tokens(client, prompt, items)) == 8


async def test_a_mask_moved_onto_another_images_placeholders_cannot_poison_the_cache(
    vlm_gateway, processor, offline
):
    """vLLM keys cached blocks by (content id, offset), not by the mask. A client stretches
    image B's range over image B2's placeholders and marks B2's tokens with B's tensors: the
    gateway refuses it (its embedding positions are not the range's placeholder tokens);
    another client's honest request for [B, B2] then gets offline vLLM's tokens."""
    prompt, (b, b2) = _processed(processor, CASES[5])
    stretched = msgspec.structs.replace(
        b,
        length=b2.offset + b2.length - b.offset,
        is_embed=[False] * (b2.offset - b.offset) + list(b2.is_embed),
    )
    async with (
        AsyncClient(vlm_gateway.addresses[0], name="attacker") as attacker,
        AsyncClient(vlm_gateway.addresses[0], name="honest") as honest,
    ):
        assert item_problem(attacker.hello_ack.model, prompt, stretched)
        with pytest.raises(RequestFailed) as info:
            await _tokens(attacker, prompt, [stretched])
        assert info.value.code is ErrorCode.INVALID_REQUEST
        assert "is_embed leaves it out" in info.value.message
        assert await _tokens(honest, prompt, [b, b2]) == offline[5]


async def test_a_text_model_refuses_items(real_gateway, processor):
    prompt, items = _processed(processor, CASES[0])
    async with AsyncClient(real_gateway.addresses[0]) as client:
        assert client.hello_ack.model.modalities == []
        assert client.hello_ack.limits.max_multimodal_items == 0
        # With its tensors the Generate would not fit the text model's frame limit.
        bare = [msgspec.structs.replace(item, tensors=None) for item in items]
        with pytest.raises(RequestFailed) as caught:
            await _tokens(client, prompt, bare)
        assert caught.value.code is ErrorCode.UNSUPPORTED
        assert "takes no multimodal items" in str(caught.value)


async def test_the_blocking_client_and_the_metrics(vlm_gateway, processor, offline):
    from prometheus_client import CollectorRegistry, generate_latest

    from client import Client
    from gateway.metrics import GatewayCollector

    prompt, items = _processed(processor, CASES[4])

    def run() -> list[list[int]]:  # in a thread: the gateway runs on this test's loop
        with Client(vlm_gateway.addresses[0]) as client:
            return [
                [t for out in client.generate(p, greedy(8), multimodal=items)
                 for t in out.new_token_ids]
                for p in (prompt, [55, *prompt[1:]])  # the second by hash, an encoder hit
            ]  # fmt: skip

    first, _ = await asyncio.to_thread(run)
    assert first == offline[4]
    await vlm_gateway.engine.encoder_cache_counts()  # what the 5 s poll keeps fresh
    registry = CollectorRegistry()
    registry.register(GatewayCollector(vlm_gateway))
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in generate_latest(registry).decode().splitlines()
        if line and not line.startswith("#")
    }
    stats = vlm_gateway.table.gateway_stats()
    assert values["engine_gateway_multimodal_items_total"] == stats["multimodal_items"] > 0
    assert values["engine_gateway_multimodal_item_bytes_total"] == stats["multimodal_item_bytes"]
    assert values["engine_gateway_multimodal_items_by_hash_total"] >= 1
    assert values["engine_gateway_encoder_runs_total"] >= 1
    assert values["engine_gateway_encoder_cache_hits_total"] >= 1
