"""No request admitted after a weight change reuses KV computed under other weights (issue
36): the prefix cache still holds the old weights' blocks when vLLM could not reset it (a
request in flight across the change holds blocks), and the gateway's cache salt keeps new
requests off them. Each flow is checked against offline ``LLM.generate`` on the new
weights, on this machine, with prompts that share whole KV blocks with the earlier ones."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from client import RequestOptions
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.gateway.test_control import collect, greedy, tokens_so_far, until
from tests.helpers import RecordingClient

pytestmark = pytest.mark.engine

# Two whole 128-token blocks shared by every prompt, then a tail of its own.
SHARED = [(7 * i + 3) % 500 + 4 for i in range(260)]
PROMPTS = [SHARED + [40 + k, 41 + k, 42 + k, 43 + k] for k in (0, 10, 20)]
OUTPUT = 12


@pytest.fixture
async def client(small_gateway):
    async with RecordingClient(small_gateway.addresses[0], name="trainer") as c:
        yield c
    assert not small_gateway.table.paused, "a test left the engine paused"


def offline(model: str, cases: list[dict]) -> asyncio.Future:
    from tests.offline_reference import run_offline_reference

    return asyncio.ensure_future(
        asyncio.to_thread(run_offline_reference, model, TEST_MAX_MODEL_LEN, cases)
    )


def greedy_cases(lora: list | None = None) -> list[dict]:
    sampling = {"temperature": 0.0, "max_tokens": OUTPUT, "ignore_eos": True}
    return [
        {"prompt": p, "sampling": sampling, **({"lora": lora} if lora else {})} for p in PROMPTS
    ]


async def warm(client, options=None) -> list[list[int]]:
    """Run every prompt (filling the prefix cache); the second run of the first must hit."""
    outs = [await client.complete(p, greedy(OUTPUT), options=options) for p in PROMPTS]
    again = await client.complete(PROMPTS[0], greedy(OUTPUT), options=options)
    assert again.cached_tokens >= 256 and again.token_ids == outs[0].token_ids
    return [o.token_ids for o in outs]


async def across_a_change(client, change, request_id: str) -> dict:
    """``change()`` between pause(keep) and resume while a request holds KV blocks."""
    across = asyncio.ensure_future(collect(client, [3, 3, 3], greedy(300), request_id))
    await until(lambda: tokens_so_far(client, request_id) >= 10)
    await client.pause("keep")
    try:
        result = await change()
    finally:
        await client.resume()
    done = await across
    assert done.output_tokens == 300
    return result


async def test_prompts_after_a_reload_never_reuse_the_old_weights_kv(client):
    """pause(keep) -> ReloadWeights(B) -> resume with a request in flight: vLLM cannot reset
    the prefix cache, whose blocks of A match every later prompt's first 256 tokens; each
    later prompt still equals offline vLLM on B, and a prompt repeated under B hits."""
    from gateway.tiny_model import ensure_tiny_model

    model_a, model_b = ensure_tiny_model(), ensure_tiny_model(weights_seed=1)
    reference_b = offline(str(model_b), greedy_cases())
    on_a = await warm(client)
    version_a = (await client.complete([5], greedy(1))).weight_versions[0].version

    async def reload_b():
        return await client.reload_weights(str(model_b), version="salt-b")

    done = await across_a_change(client, reload_b, "across-reload")
    assert done.result == {"prefix_cache_reset": False, "weight_version": "salt-b"}
    try:
        on_b = [(await client.complete(p, greedy(OUTPUT))).token_ids for p in PROMPTS]
        want = [r["samples"][0]["token_ids"] for r in await reference_b]
        assert on_b == want
        assert on_b != on_a  # the weights did change what these prompts give
        again = await client.complete(PROMPTS[1], greedy(OUTPUT))  # within B: hits
        assert again.cached_tokens >= 256 and again.token_ids == want[1]
    finally:
        await client.reload_weights(str(model_a), version=version_a)
    # Back on A under A's version: A's blocks are A's KV, and A's outputs come back.
    assert [(await client.complete(p, greedy(OUTPUT))).token_ids for p in PROMPTS] == on_a


async def test_a_reload_without_a_version_then_set_weight_version_never_reuses_old_kv(client):
    """Weights changed with no new version (ReloadWeights without one), then named with
    SetWeightVersion: prompts in between and after equal offline vLLM on the new weights."""
    from gateway.tiny_model import ensure_tiny_model

    model_a, model_b = ensure_tiny_model(), ensure_tiny_model(weights_seed=1)
    reference_b = offline(str(model_b), greedy_cases())
    on_a = await warm(client)
    version_a = (await client.complete([5], greedy(1))).weight_versions[0].version

    async def reload_b_unnamed():
        return await client.reload_weights(str(model_b))

    done = await across_a_change(client, reload_b_unnamed, "across-unnamed")
    assert done.result == {"prefix_cache_reset": False, "weight_version": None}
    try:
        want = [r["samples"][0]["token_ids"] for r in await reference_b]
        assert want != on_a
        assert (await client.complete(PROMPTS[0], greedy(OUTPUT))).token_ids == want[0]
        await client.set_weight_version("named-b")
        named = [await client.complete(p, greedy(OUTPUT)) for p in PROMPTS]
        assert [c.token_ids for c in named] == want
        assert {c.weight_versions[0].version for c in named} == {"named-b"}
    finally:
        await client.reload_weights(str(model_a), version=version_a)


async def test_an_adapter_loaded_again_under_its_name_and_path_never_reuses_its_old_kv(
    client, tmp_path
):
    """UnloadLora, new files in the same folder, LoadLora under the same name: vLLM's block
    hashes name an adapter by name and path only, so its old KV would match; the prompts
    with the adapter equal offline vLLM with the new adapter."""
    from gateway.tiny_model import ensure_tiny_model
    from tests.lora_adapter import make_tiny_lora

    folder = tmp_path / "style"
    first = make_tiny_lora(tmp_path / "first", seed=5)
    second = make_tiny_lora(tmp_path / "second", seed=6)
    reference = offline(str(ensure_tiny_model()), greedy_cases(["style", 1, str(second)]))
    shutil.copytree(first, folder)
    options = RequestOptions(lora_name="style")
    await client.load_lora("style", str(folder))
    try:
        on_first = await warm(client, options)

        async def swap_adapter():
            await client.unload_lora("style")
            shutil.rmtree(folder)
            shutil.copytree(second, folder)
            return await client.load_lora("style", str(folder))

        await across_a_change(client, swap_adapter, "across-lora")
        on_second = [
            (await client.complete(p, greedy(OUTPUT), options=options)).token_ids for p in PROMPTS
        ]
        want = [r["samples"][0]["token_ids"] for r in await reference]
        assert on_second == want != on_first
        again = await client.complete(PROMPTS[2], greedy(OUTPUT), options=options)
        assert again.cached_tokens >= 256 and again.token_ids == want[2]
    finally:
        await client.unload_lora("style")
