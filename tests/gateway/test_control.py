"""Control plane on the real engine: pause (abort, wait, keep) and resume, prefix-cache
reset, stats, and authorization. The gateway here (small_gateway) lets every client call
control operations; the shared real_gateway lets none."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile

import pytest

from client import FinishReason, RequestFailed
from codec import ErrorCode
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.helpers import RecordingClient, collect, greedy, tokens_so_far, until

pytestmark = pytest.mark.engine


@pytest.fixture
async def client(small_gateway):
    async with RecordingClient(small_gateway.addresses[0], name="trainer") as c:
        yield c
    assert not small_gateway.table.paused, "a test left the engine paused"


async def test_pause_keep_then_resume_gives_the_unpaused_output(client):
    # 400 tokens: the run must still be going when the pause lands, however starved the box.
    reference = (await client.complete([3, 4, 5], greedy(400))).token_ids
    run = asyncio.ensure_future(collect(client, [3, 4, 5], greedy(400), "kept"))
    await until(lambda: tokens_so_far(client, "kept") >= 10)
    done = await client.pause("keep")
    assert done.operation == "pause" and (await client.health()).paused
    frozen = tokens_so_far(client, "kept")
    # A Generate sent during the pause is accepted and waits.
    late = asyncio.ensure_future(collect(client, [6, 7], greedy(5), "late"))
    await asyncio.sleep(0.5)
    assert tokens_so_far(client, "kept") == frozen and tokens_so_far(client, "late") == 0
    assert not run.done() and not late.done()
    await client.resume()
    assert not (await client.health()).paused
    assert (await run).token_ids == reference
    assert (await late).token_ids == (await client.complete([6, 7], greedy(5))).token_ids


async def test_pause_abort_ends_live_requests_with_their_partial_tokens(client):
    runs = [
        asyncio.ensure_future(collect(client, [10 + i], greedy(400), f"ab{i}")) for i in range(2)
    ]
    await until(lambda: min(tokens_so_far(client, f"ab{i}") for i in range(2)) >= 3)
    await client.pause("abort")
    for i, run in enumerate(runs):
        ended = await run
        assert ended.finish_reason is FinishReason.ABORT
        assert 0 < ended.output_tokens == len(ended.token_ids) < 400
        assert len(client.terminals(f"ab{i}")) == 1 and client.outputs_after_terminal(f"ab{i}") == 0
    await client.resume()
    assert (await client.complete([1, 2], greedy(4))).output_tokens == 4


async def test_pause_wait_replies_once_in_flight_requests_finished(client):
    runs = [asyncio.ensure_future(collect(client, [20 + i], greedy(60))) for i in range(2)]
    await until(lambda: client.frames != [] and any(not r.done() for r in runs))
    await asyncio.sleep(0.05)
    await client.pause("wait")
    assert all(run.done() for run in runs)  # their terminals came before the reply
    assert [(await run).output_tokens for run in runs] == [60, 60]
    await client.resume()


async def test_reset_prefix_cache_and_stats(client, small_gateway):
    prompt = [(i * 5) % 400 + 3 for i in range(200)]
    await client.complete(prompt, greedy(2))
    assert (await client.complete(prompt, greedy(2))).cached_tokens == 128
    assert await client.reset_prefix_cache() is True
    assert (await client.complete(prompt, greedy(2))).cached_tokens == 0
    # Stats: running while requests run, 0 after; the gateway's own counts beside them.
    runs = [asyncio.ensure_future(collect(client, [30 + i], greedy(200))) for i in range(2)]
    await until(lambda: client.frames and all(not r.done() for r in runs))
    await asyncio.sleep(0.1)
    busy = await client.stats()
    (engine,) = busy.engines
    assert engine.engine_index == 0 and engine.running == 2 and 0 < engine.kv_cache_usage < 1
    assert engine.prefix_cache_queries > 0 and busy.gateway["live_requests"] == 2
    await asyncio.gather(*runs)
    idle = await client.stats()
    assert idle.engines[0].running == 0 and idle.gateway["live_requests"] == 0


async def test_control_under_load_loses_no_other_request(client, small_gateway, tmp_path):
    from gateway.tiny_model import ensure_tiny_model
    from tests.lora_adapter import make_tiny_lora

    async with RecordingClient(small_gateway.addresses[0], name="bystander") as other:
        alone = [(await collect(other, [40 + i], greedy(30))).token_ids for i in range(4)]
        runs = [
            asyncio.ensure_future(collect(other, [40 + i], greedy(30), f"o{i}")) for i in range(4)
        ]
        await until(lambda: other.frames != [])
        await client.stats()
        await client.reset_prefix_cache()
        await client.pause("keep")
        counts = (await client.stats()).gateway  # any call while paused
        await client.reload_weights(str(ensure_tiny_model()))  # the same weights again
        await client.load_lora("u", str(make_tiny_lora(tmp_path / "u")))
        await client.list_loras()
        await client.resume()
        await client.unload_lora("u")
        assert counts["live_requests"] >= 1
        results = await asyncio.gather(*runs)
        assert [r.token_ids for r in results] == alone
        for i in range(4):
            assert len(other.terminals(f"o{i}")) == 1 and other.outputs_after_terminal(f"o{i}") == 0


async def test_unauthorized_clients_are_refused_and_the_engine_is_untouched(real_gateway):
    async with RecordingClient(real_gateway.addresses[0], name="stranger") as stranger:
        run = asyncio.ensure_future(collect(stranger, [9], greedy(TEST_MAX_MODEL_LEN // 4)))
        for call in (
            stranger.pause("abort"),
            stranger.pause("keep"),
            stranger.resume(),
            stranger.reset_prefix_cache(),
            stranger.stats(),
            stranger.reload_weights("/nonexistent", version="evil"),
            stranger.set_weight_version("evil"),
            stranger.load_lora("x", "/nonexistent"),
            stranger.unload_lora("x"),
            stranger.list_loras(),
            stranger.sleep(1),
            stranger.wake_up(),
        ):
            with pytest.raises(RequestFailed) as info:
                await call
            assert info.value.code is ErrorCode.UNAUTHORIZED
            assert "not allowed" in info.value.message
        assert not real_gateway.table.paused and not (await stranger.health()).paused
        assert (await run).finish_reason is FinishReason.LENGTH  # not aborted, not frozen


async def test_weight_reload_between_pause_and_resume_with_version_spans(client):
    """Model B: the tiny model's shape with other weights. After reloading B's files the
    gateway's greedy output equals offline LLM.generate on B, and a request that ran across
    pause(keep) -> reload -> resume reports two version spans adding up to its tokens."""
    from gateway.tiny_model import ensure_tiny_model
    from tests.offline_reference import run_offline_reference

    model_a, model_b = ensure_tiny_model(), ensure_tiny_model(weights_seed=1)
    prompt = [17, 18, 19, 20]
    offline_b = asyncio.ensure_future(
        asyncio.to_thread(
            run_offline_reference,
            str(model_b),
            TEST_MAX_MODEL_LEN,
            [{"prompt": prompt, "sampling": {"temperature": 0.0, "max_tokens": 24}}],
            keep=True,
        )
    )
    before = await client.complete(prompt, greedy(24))
    (span,) = before.weight_versions
    assert (span.first_token, span.num_tokens) == (0, 24)
    old = span.version
    # A request that runs across the reload.
    across = asyncio.ensure_future(collect(client, [3, 3, 3], greedy(120), "across"))
    await until(lambda: tokens_so_far(client, "across") >= 10)
    await client.pause("keep")
    try:
        done = await client.reload_weights(str(model_b), version="policy-2")
    finally:
        await client.resume()
    # The paused request holds cache blocks, so vLLM does not reset the prefix cache now.
    assert done.result == {"prefix_cache_reset": False, "weight_version": "policy-2"}
    spanned = await across
    first, second = spanned.weight_versions
    assert first.version == old and second.version == "policy-2"
    assert first.first_token == 0 and second.first_token == first.num_tokens >= 10
    assert first.num_tokens + second.num_tokens == spanned.output_tokens == 120
    # Streamed outputs named the version where it changed.
    named = [
        o.weight_version
        for f in client.frames
        for o in f.outputs
        if o.request_id == "across" and o.weight_version
    ]
    assert named == [old, "policy-2"]
    after = await client.complete(prompt, greedy(24))
    ((reference,),) = [r["samples"] for r in await offline_b]
    assert after.token_ids == reference["token_ids"] != before.token_ids
    assert [(s.version, s.num_tokens) for s in after.weight_versions] == [("policy-2", 24)]
    # Back to A for the other tests (nothing running: the prefix cache is reset too).
    done = await client.reload_weights(str(model_a), version=old)
    assert done.result == {"prefix_cache_reset": True, "weight_version": old}
    assert (await client.complete(prompt, greedy(24))).token_ids == before.token_ids


async def test_lora_loaded_at_runtime_matches_offline_and_unloads(client, tmp_path):
    from client import RequestOptions
    from gateway.tiny_model import ensure_tiny_model
    from tests.lora_adapter import make_tiny_lora
    from tests.offline_reference import run_offline_reference

    adapter = str(make_tiny_lora(tmp_path / "adapter", seed=5))
    prompt = [21, 22, 23]
    sampling = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    offline = asyncio.ensure_future(
        asyncio.to_thread(
            run_offline_reference,
            str(ensure_tiny_model()),
            TEST_MAX_MODEL_LEN,
            [{"prompt": prompt, "sampling": sampling, "lora": ["style", 1, adapter]}],
            keep=True,
        )
    )
    base = await client.complete(prompt, greedy(16))
    with pytest.raises(RequestFailed) as info:  # not loaded yet
        await client.complete(prompt, greedy(4), options=RequestOptions(lora_name="style"))
    assert info.value.code is ErrorCode.UNSUPPORTED
    assert (await client.load_lora("style", adapter)).operation == "load_lora"
    assert await client.list_loras() == ["style"]
    tuned = await client.complete(prompt, greedy(16), options=RequestOptions(lora_name="style"))
    ((reference,),) = [r["samples"] for r in await offline]
    assert tuned.token_ids == reference["token_ids"] != base.token_ids
    await client.unload_lora("style")
    assert await client.list_loras() == []
    with pytest.raises(RequestFailed) as info:
        await client.complete(prompt, greedy(4), options=RequestOptions(lora_name="style"))
    assert info.value.code is ErrorCode.UNSUPPORTED
    with pytest.raises(RequestFailed) as info:  # unloading twice: the name is unknown
        await client.unload_lora("style")
    assert info.value.code is ErrorCode.UNSUPPORTED


async def test_sleep_and_wake_up_are_unsupported_on_cpu_with_vllms_reason(client):
    for call in (client.sleep(1), client.wake_up()):
        with pytest.raises(RequestFailed) as info:
            await call
        assert info.value.code is ErrorCode.UNSUPPORTED
        assert "Sleep mode is not supported on current platform" in info.value.message
    assert not (await client.health()).paused  # nothing was paused on the way
    assert (await client.complete([1, 2], greedy(3))).output_tokens == 3


def tiny_model_tensors() -> dict:
    from safetensors.torch import load_file

    from gateway.tiny_model import ensure_tiny_model

    tensors = {}
    for file in sorted(ensure_tiny_model().glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def write_bad_checkpoints(root) -> dict[str, tuple[str, str]]:
    """Checkpoints vLLM's reload cannot load, each with what the refusal must name."""
    import json

    import torch
    from safetensors.torch import save_file

    tensors = tiny_model_tensors()
    rows, width = tensors["model.embed_tokens.weight"].shape
    cases = {"missing": (str(root / "missing"), "is not a folder on the engine's machine")}
    cases["empty path"] = ("", "'' is not a folder on the engine's machine")
    (root / "empty").mkdir()
    cases["empty"] = (str(root / "empty"), "holds no weight files")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b"not json")
    cases["corrupt"] = (str(root / "corrupt"), "is not a readable safetensors file")
    checkpoints = {
        # Every tensor right but one: vLLM's reload would finish other layers before it.
        "stranger": {**tensors, "model.layers.9.mlp.extra.weight": torch.zeros(4, 4)},
        "shape": {**tensors, "model.embed_tokens.weight": torch.zeros(rows + 8, width)},
    }
    for name, checkpoint in checkpoints.items():
        (root / name).mkdir()
        save_file(checkpoint, root / name / "model.safetensors")
    cases["stranger"] = (str(root / "stranger"), "tensor 'model.layers.9.mlp.extra.weight'")
    cases["shape"] = (
        str(root / "shape"),
        f"'model.embed_tokens.weight' of shape [{rows + 8}, {width}]",
    )
    (root / "index").mkdir()
    save_file(tensors, root / "index" / "model-00001-of-00002.safetensors")
    weight_map = {
        n: f"model-0000{1 + (n == 'lm_head.weight')}-of-00002.safetensors" for n in tensors
    }
    (root / "index" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map})
    )
    cases["index"] = (str(root / "index"), "referenced in index but missing")
    # A named pipe blocked vLLM's read, and every engine step with it, for good.
    (root / "pipe").mkdir()
    save_file(tensors, root / "pipe" / "model-00001-of-00002.safetensors")
    os.mkfifo(root / "pipe" / "model-00002-of-00002.safetensors")
    cases["pipe"] = (
        str(root / "pipe"),
        f"{str(root / 'pipe' / 'model-00002-of-00002.safetensors')!r} is a named pipe",
    )
    (root / "device").mkdir()
    (root / "device" / "model.safetensors").symlink_to("/dev/zero")
    cases["device"] = (str(root / "device"), "model.safetensors' is a character device")
    return cases


async def test_a_checkpoint_vllm_cannot_load_is_refused_by_name_and_nothing_changes(
    client, tmp_path
):
    """vLLM's reload moves every layer to the meta device before reading the files: a wrong
    path or a tensor that does not fit used to leave the engine without weights, dead at its
    next step for every client. The gateway refuses each such checkpoint, naming why, and
    the engine serves on with its weights and version unchanged."""
    prompt = [17, 18, 19, 20]
    before = await client.complete(prompt, greedy(16))
    for case, (path, named) in write_bad_checkpoints(tmp_path).items():
        with pytest.raises(RequestFailed) as info:
            await client.reload_weights(path, version="never")
        assert info.value.code is ErrorCode.INVALID_REQUEST, case
        assert (
            info.value.message.startswith("ReloadWeights failed: ") and named in info.value.message
        ), case
        after = await client.complete(prompt, greedy(16))
        assert after.token_ids == before.token_ids, case
        assert after.weight_versions == before.weight_versions, case
    assert (await client.health()).state == "serving"


async def test_a_reload_failing_part_way_refuses_generation_until_a_whole_checkpoint(
    client, tmp_path
):
    """A checkpoint without safetensors headers to check (torch .bin shards) whose second
    half fails to load: the layers loaded so far keep their new weights, the others get
    their old ones back. That model mixes two sets of weights: as after a weight update
    failed part-way, the call, live requests and new ones get WEIGHTS_INCOMPLETE (issue 48
    item 3), until a ReloadWeights of a whole checkpoint gives the old output back."""
    import torch

    from gateway.tiny_model import ensure_tiny_model

    tensors = tiny_model_tensors()
    shards = [
        {n: t * 0.5 for n, t in tensors.items() if f"layers.{layer}." in n} for layer in (0, 1)
    ]
    # Shard 2 ends with a tensor of the wrong shape: whichever shard vLLM reads first, at
    # least one whole layer is loaded (and processed) before the failure.
    shards[1]["model.norm.weight"] = torch.zeros(7)
    for i, shard in enumerate(shards, 1):
        torch.save(shard, tmp_path / f"pytorch_model-0000{i}-of-00002.bin")
    prompt = [17, 18, 19, 20]
    before = await client.complete(prompt, greedy(16))
    with pytest.raises(RequestFailed) as info:
        await client.reload_weights(str(tmp_path), version="half")
    assert info.value.code is ErrorCode.WEIGHTS_INCOMPLETE
    assert (
        "failed part-way" in info.value.message and "layers took new weights" in info.value.message
    )
    with pytest.raises(RequestFailed) as refused:
        await client.complete(prompt, greedy(16))
    assert refused.value.code is ErrorCode.WEIGHTS_INCOMPLETE
    await client.reload_weights(str(ensure_tiny_model()))
    assert (await client.complete(prompt, greedy(16))).token_ids == before.token_ids


async def test_an_adapter_vllm_cannot_load_is_refused_with_vllm_s_words(client, tmp_path):
    from client import RequestOptions
    from tests.lora_adapter import make_tiny_lora

    corrupt = make_tiny_lora(tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage")
    pipe = make_tiny_lora(tmp_path / "pipe")  # its copy blocked the engine for good
    (pipe / "adapter_model.safetensors").unlink()
    os.mkfifo(pipe / "adapter_model.safetensors")
    device = make_tiny_lora(tmp_path / "device")  # /dev/zero: an endless copy
    (device / "adapter_model.safetensors").unlink()
    (device / "adapter_model.safetensors").symlink_to("/dev/null")
    huge = make_tiny_lora(tmp_path / "huge")  # its copy filled the disk engine and host share
    found = os.statvfs(tempfile.gettempdir())  # where the workers copy adapters
    os.truncate(huge / "adapter_model.safetensors", found.f_blocks * found.f_frsize + (1 << 30))
    huge_bytes = sum(f.stat().st_size for f in huge.iterdir())
    for path, named in [
        (str(tmp_path / "missing"), "No adapter found for"),
        (str(corrupt), "Error while deserializing header"),
        (str(pipe), "adapter_model.safetensors' is a named pipe, not a regular file"),
        (str(device), "adapter_model.safetensors' is a character device"),
        (str(huge), f"{str(huge)!r} holds {huge_bytes:,} bytes of files: more than"),
    ]:
        with pytest.raises(RequestFailed) as info:
            await client.load_lora("bad", path)
        assert info.value.code is ErrorCode.INVALID_REQUEST
        assert info.value.message.startswith("LoadLora failed: ") and named in info.value.message
        assert "stack trace" not in info.value.message  # it points at a log the client lacks
    assert await client.list_loras() == []
    with pytest.raises(RequestFailed):
        await client.complete([1, 2], greedy(2), options=RequestOptions(lora_name="bad"))


async def test_a_lora_module_is_loaded_at_start_and_one_vllm_cannot_load_is_refused(
    client, small_gateway, tmp_path
):
    """What ``--lora-module NAME=PATH`` does at start (VllmEngine._load_static_lora), on the
    running engine: the adapter is usable by name at once and gives what the same adapter
    loaded at runtime gives; a corrupt one is refused naming it, and the engine serves on."""
    from client import RequestOptions
    from gateway.vllm import LoraModuleRefused
    from tests.lora_adapter import make_tiny_lora

    engine, prompt = small_gateway.engine, [17, 18, 19, 20]
    adapter = str(make_tiny_lora(tmp_path / "adapter", seed=5))
    await engine._load_static_lora("static", 90, adapter)
    try:
        await client.load_lora("runtime", adapter)
        assert await client.list_loras() == ["runtime", "static"]
        outputs = [
            (
                await client.complete(prompt, greedy(16), options=RequestOptions(lora_name=n))
            ).token_ids
            for n in ("static", "runtime")
        ]
        assert outputs[0] == outputs[1] != (await client.complete(prompt, greedy(16))).token_ids
    finally:
        await client.unload_lora("static")
        await client.unload_lora("runtime")
    corrupt = make_tiny_lora(tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoraModuleRefused) as info:
        await engine._load_static_lora("bad", 91, str(corrupt))
    assert str(info.value).startswith(f"bad={corrupt}: loading the adapter failed: ")
    assert await client.list_loras() == []
    assert len((await client.complete(prompt, greedy(4))).token_ids) == 4


async def test_an_adapter_whose_folder_is_deleted_or_rewritten_after_loading_serves_on(
    client, tmp_path
):
    """vLLM keeps one adapter in its CPU cache here (--max-cpu-loras defaults to --max-loras,
    1) and reads an evicted one from its folder again, inside an engine step: a trainer that
    deleted the folder after LoadLora killed the engine for every client, and one that
    rewrote it got other weights under the old name. Each worker now loads from a private
    copy made at LoadLora, removed at UnloadLora."""
    import glob
    import os
    import shutil
    import tempfile

    import psutil

    from client import RequestOptions
    from gateway.vllm.plugin import copies_owner
    from tests.lora_adapter import make_tiny_lora

    prompt = [17, 18, 19, 20]
    folders = {
        name: make_tiny_lora(tmp_path / name, seed=seed) for name, seed in [("a", 1), ("b", 2)]
    }

    async def run(name):
        options = RequestOptions(lora_name=name)
        return (await client.complete(prompt, greedy(16), options=options)).token_ids

    loaded = {}
    for name, folder in folders.items():
        await client.load_lora(name, str(folder))
        loaded[name] = await run(name)
    assert loaded["a"] != loaded["b"]
    try:
        shutil.rmtree(folders["a"])  # gone
        make_tiny_lora(folders["b"], seed=3)  # rewritten with other weights
        bystander = asyncio.ensure_future(collect(client, [3, 3, 3], greedy(200)))
        for name in ["a", "b", "a", "b"]:  # each evicts the other from vLLM's cache
            assert await run(name) == loaded[name], name
        assert len((await bystander).token_ids) == 200
    finally:
        await client.unload_lora("a")
        await client.unload_lora("b")
    # The copies went with the adapters: the engine's worker holds none now (this session's
    # worker: another test session's engines may hold theirs).
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    roots = glob.glob(os.path.join(tempfile.gettempdir(), "engine-gateway-lora-*-*"))
    live = [r for r in roots if copies_owner(r) in ours]
    assert live and all(os.listdir(r) == [] for r in live), {r: os.listdir(r) for r in live}


async def test_two_adapters_loaded_at_once_each_serve_their_own_weights(client, tmp_path):
    """Two LoadLora sent together (they used to pick the same adapter id, and vLLM served
    one adapter under both names), and a second load of a name at the same time: each name
    gives offline vLLM's output with its own adapter; the duplicate is refused."""
    from client import RequestOptions
    from gateway.tiny_model import ensure_tiny_model
    from tests.lora_adapter import make_tiny_lora
    from tests.offline_reference import run_offline_reference

    u = str(make_tiny_lora(tmp_path / "u", seed=5))
    w = str(make_tiny_lora(tmp_path / "w", seed=6))
    prompt = [21, 22, 23]
    sampling = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    offline = asyncio.ensure_future(
        asyncio.to_thread(
            run_offline_reference,
            str(ensure_tiny_model()),
            TEST_MAX_MODEL_LEN,
            [
                {"prompt": prompt, "sampling": sampling, "lora": ["u2", 1, u]},
                {"prompt": prompt, "sampling": sampling, "lora": ["w2", 2, w]},
            ],
        )
    )
    results = await asyncio.gather(
        client.load_lora("u2", u),
        client.load_lora("w2", w),
        client.load_lora("u2", w),
        return_exceptions=True,
    )
    try:
        assert [r.result for r in results[:2]] == ["u2", "w2"], results
        assert isinstance(results[2], RequestFailed) and "already loaded" in str(results[2])
        tuned = {
            name: (
                await client.complete(prompt, greedy(16), options=RequestOptions(lora_name=name))
            ).token_ids
            for name in ("u2", "w2")
        }
        want = [r["samples"][0]["token_ids"] for r in await offline]
        assert [tuned["u2"], tuned["w2"]] == want and want[0] != want[1]
    finally:
        for name in ("u2", "w2"):
            with contextlib.suppress(RequestFailed):
                await client.unload_lora(name)
