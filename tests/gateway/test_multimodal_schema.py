"""The schema learnt from a processor's items, on Qwen2-VL's images: the architecture the
multimodal wire was made for, whose vLLM module cannot load on this CPU wheel (its HF
processor needs torchvision). Its items are made here as vLLM's Qwen2-VL processor makes
them: transformers' own Qwen2-VL image processor (the PIL one), split per image with the
fields of vLLM's ``_create_qwen2vl_field_factory`` (pixel rows flat by the grid's product,
the grid batched), and one ``<|image_pad|>`` per 2x2 merged patch. No engine runs: the
models that do run here go through the same code end to end in test_multimodal*.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from client import MultimodalItem
from client.multimodal_check import item_problem
from client.multimodal_processor import to_wire_tensor
from codec import EmbeddingRule, ItemSchema, ModelInfo, TensorSchema
from gateway.errors import RequestRejected
from tests.helpers import noise_image

torch = pytest.importorskip("torch")

VISION_START, IMAGE_PAD, VISION_END = 151652, 151655, 151653
MERGE = 2


@pytest.fixture(scope="module")
def image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(merge_size=MERGE)


def qwen2_vl_probe(image_processor, image, text=(9, 10)):
    """(vLLM item, placeholder, prompt ids) for one image, as vLLM's Qwen2-VL processor."""
    from vllm.multimodal.inputs import (
        MultiModalFieldConfig,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    out = image_processor(images=[image], return_tensors="pt")
    grid = out["image_grid_thw"]
    fields = {
        "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
        "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
    }
    item = MultiModalKwargsItems.from_hf_inputs(out, fields)["image"][0]
    pads = int(grid.prod()) // MERGE**2
    prompt = [VISION_START, *[IMAGE_PAD] * pads, VISION_END, *text]
    return item, PlaceholderRange(offset=1, length=pads), prompt


@pytest.fixture(scope="module")
def schema(image_processor):
    from gateway.vllm.multimodal import _probe_sizes, schema_from_probes

    probes = [
        qwen2_vl_probe(image_processor, noise_image(w, h, 7)) for w, h in _probe_sizes(1344, 1008)
    ]
    return schema_from_probes("image", probes)


def wire_item(item, placeholder, hash_="h") -> MultimodalItem:
    tensors = {name: to_wire_tensor(elem.data) for name, elem in item.items()}
    return MultimodalItem("image", hash_, placeholder.offset, placeholder.length, None, tensors)


def inputs_for(schema):
    from gateway.vllm.multimodal import MultimodalInputs

    return MultimodalInputs({"image": schema}, torch.bfloat16)


def test_the_qwen2_vl_rules_are_learnt(schema):
    pixels, grid = schema.keys["pixel_values"], schema.keys["image_grid_thw"]
    assert (pixels.fixed, pixels.follows) == ({1: 3 * 2 * 14 * 14}, {0: "image_grid_thw"})
    assert grid.fixed == {0: 3}
    # An image is one temporal patch; its grid's height and width fold by the merge size.
    assert (grid.pinned, grid.multiple_of) == ({0: 1}, {1: MERGE, 2: MERGE})
    assert (schema.count_key, schema.scale, schema.divide) == ("image_grid_thw", 4, True)
    assert schema.placeholder_ids == {IMAGE_PAD}
    # As HelloAck.model.multimodal says it to clients:
    assert schema.wire() == ItemSchema(
        {
            "image_grid_thw": TensorSchema("int64", [3], [1, None, None], [1, MERGE, MERGE]),
            # CLIP's normalisation makes [-1.79, 2.15]; widened by its span on each side.
            "pixel_values": TensorSchema("float32", ["image_grid_thw", 1176], value_range=[-6, 7]),
        },
        [IMAGE_PAD],
        EmbeddingRule("image_grid_thw", 4, divide=True),
    )


@pytest.mark.parametrize("size", [(300, 170), (57, 900), (28, 28)])
def test_an_image_of_a_size_never_probed_is_accepted(schema, image_processor, size):
    item, placeholder, prompt = qwen2_vl_probe(image_processor, noise_image(*size, 3))
    built = inputs_for(schema).build(prompt, [wire_item(item, placeholder)], cache_salt="")
    got = built["mm_kwargs"]["image"][0]
    assert torch.equal(got["image_grid_thw"].data, item["image_grid_thw"].data)
    assert torch.equal(got["pixel_values"].data, item["pixel_values"].data.to(torch.bfloat16))
    assert got["pixel_values"].field == item["pixel_values"].field  # flat, as vLLM's
    assert built["mm_placeholders"]["image"][0].length == placeholder.length


def _qwen2_vl_item(grid: tuple[int, int, int], rows: int, pads: int, width: int = 1176):
    item = MultimodalItem(
        "image",
        "bad",
        1,
        pads,
        None,
        {
            "pixel_values": to_wire_tensor(torch.zeros(rows, width, dtype=torch.bfloat16)),
            "image_grid_thw": to_wire_tensor(torch.tensor(grid)),
        },
    )
    return [VISION_START, *[IMAGE_PAD] * pads, VISION_END], item


@pytest.mark.parametrize(
    ("grid", "rows", "pads", "width", "named"),
    [
        # An odd height: 12 patches, 3 embeddings, all consistent, and vLLM's Qwen2-VL
        # rot_pos_emb would fail to reshape it inside the engine (ENGINE_DEAD for all).
        ((1, 3, 4), 12, 3, 1176, "tensors['image_grid_thw'][1] is 3; the model's processor"),
        ((1, 4, 6), 24, 6, 1176, None),  # the same area, even: accepted
        ((2, 4, 4), 32, 8, 1176, "tensors['image_grid_thw'][0] must be 1"),
        ((1, 4, 4), 15, 4, 1176, "dim 0 of tensors['pixel_values'] is 15"),
        ((1, 4, 4), 16, 5, 1176, "its tensors make 4 embeddings"),
        ((1, 4, 4), 16, 4, 1175, "dim 1 must be 1176"),
        ((1, 0, 4), 0, 0, 1176, "must be positive"),
    ],
)
def test_an_item_the_processor_would_not_make_is_refused_by_name(
    schema, grid, rows, pads, width, named
):
    prompt, item = _qwen2_vl_item(grid, rows, pads, width)
    if named is None:
        inputs_for(schema).build(prompt, [item], cache_salt="")
        return
    with pytest.raises(RequestRejected) as info:
        inputs_for(schema).build(prompt, [item], cache_salt="")
    assert info.value.message.startswith("multimodal[0]: ") and named in info.value.message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize(
    ("value", "named"),
    [
        (float("nan"), "holds NaN"),
        (float("inf"), "values from 0 to inf"),
        (float("-inf"), "values from -inf to 0"),
        (1e6, "values from 0 to "),  # rounded in bfloat16, inf in float16
        (7.5, "values from 0 to 7.5"),
        (-6.5, "values from -6.5 to 0"),
        (7.0, None),  # the range's ends: accepted
        (-6.0, None),
    ],
)
def test_a_pixel_the_processor_could_not_make_is_refused_by_the_gateway_and_the_client(
    schema, dtype, value, named
):
    """NaN, infinities and far-out values (which turn the model's activations NaN, and with
    them the KV-cache blocks vLLM hands to later requests) are refused by name; the
    client's check, from the wire schema alone, says the same."""
    prompt, item = _qwen2_vl_item((1, 4, 4), 16, 4)
    pixels = torch.zeros(16, 1176, dtype=getattr(torch, dtype))
    pixels[3, 100] = value
    item.tensors["pixel_values"] = to_wire_tensor(pixels)
    model = ModelInfo("qwen2-vl", 4096, 151936, [151645], multimodal={"image": schema.wire()})
    predicted = item_problem(model, prompt, item)
    if named is None:
        assert predicted is None
        inputs_for(schema).build(prompt, [item], cache_salt="")
        return
    assert predicted == (
        "tensors['pixel_values'] holds NaN, an infinity or a value outside [-6, 7]"
    )
    with pytest.raises(RequestRejected) as info:
        inputs_for(schema).build(prompt, [item], cache_salt="")
    assert info.value.message.startswith("multimodal[0]: tensors['pixel_values'] holds ")
    assert named in info.value.message and "within [-6, 7]" in info.value.message


def test_probes_that_follow_no_rule_are_not_served(image_processor):
    from vllm.multimodal.inputs import PlaceholderRange

    from gateway.vllm.multimodal import schema_from_probes

    sizes = [(56, 56), (112, 56), (112, 112)]
    probes = [qwen2_vl_probe(image_processor, noise_image(w, h, 1)) for w, h in sizes]
    item, placeholder, prompt = probes[1]  # its embeddings no longer follow the grid:
    probes[1] = (item, PlaceholderRange(offset=1, length=placeholder.length - 1), prompt)
    with pytest.raises(ValueError, match="follow no count"):
        schema_from_probes("image", probes)


_MUTATIONS = [
    "rows", "width", "pads", "pixel_dtype", "grid_dtype", "rank", "token", "sign", "value"
]  # fmt: skip
_OUT_OF_RANGE = [float("nan"), float("inf"), float("-inf"), 1e6, -6.5, 7.5]  # not in [-6, 7]


@st.composite
def fuzzed_items(draw):
    """A prompt and one item as Qwen2-VL's processor could make it (any grid up to 9x9,
    half of them odd), with up to two things made a little wrong."""
    grid = [
        draw(st.sampled_from([1, 1, 1, 2, 0])),
        draw(st.integers(1, 9)),
        draw(st.integers(1, 9)),
    ]
    area = grid[0] * grid[1] * grid[2]
    wrong = draw(st.sets(st.sampled_from(_MUTATIONS + ["missing"]), max_size=2))
    rows = max(area + draw(st.sampled_from([-1, 1])) * ("rows" in wrong), 0)
    width = 1175 if "width" in wrong else 1176
    pads = max(area // 4 + ("pads" in wrong), 1)
    pixel_dtype = "int32" if "pixel_dtype" in wrong else draw(st.sampled_from(_FLOATS))
    grid_dtype = draw(st.sampled_from(["bool", "float32"] if "grid_dtype" in wrong else _INTS))
    shape = [1, rows, width] if "rank" in wrong else [rows, width]
    pad_token = 5 if "token" in wrong else IMAGE_PAD
    sign = -1 if "sign" in wrong else 1
    pixels = torch.zeros(shape, dtype=getattr(torch, pixel_dtype))
    if pixels.numel() and pixels.is_floating_point():  # one value: at the range's ends, or out
        value = draw(st.sampled_from(_OUT_OF_RANGE if "value" in wrong else [-6.0, 0.5, 7.0]))
        pixels.view(-1)[draw(st.integers(0, pixels.numel() - 1))] = value
    tensors = {
        "pixel_values": to_wire_tensor(pixels),
        "image_grid_thw": to_wire_tensor(
            (sign * torch.tensor(grid)).to(getattr(torch, grid_dtype))
        ),
    }
    if "missing" in wrong:
        del tensors[draw(st.sampled_from(sorted(tensors)))]
    prompt = [VISION_START, *[pad_token] * pads, VISION_END]
    return prompt, MultimodalItem("image", "fuzz", 1, pads, None, tensors)


_FLOATS = ["float32", "bfloat16", "float16"]
_INTS = ["int64", "int32", "int16", "uint8"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fuzzed_items())
def test_any_item_is_built_as_the_engine_needs_or_refused_by_name(schema, case):
    prompt, item = case
    # A client's own check, from the wire schema alone, comes to the gateway's decision.
    model = ModelInfo("qwen2-vl", 4096, 151936, [151645], multimodal={"image": schema.wire()})
    predicted = item_problem(model, prompt, item)
    try:
        built = inputs_for(schema).build(prompt, [item], cache_salt="")
    except RequestRejected as refused:
        assert refused.message.startswith("multimodal[0]: ")
        assert predicted is not None, refused.message
        event("refused")
        return
    assert predicted is None
    event("accepted")
    # What vLLM's Qwen2-VL model relies on: a grid it can fold, rows and pads that match.
    got = built["mm_kwargs"]["image"][0]
    t, h, w = got["image_grid_thw"].data.tolist()
    assert (t, h % MERGE, w % MERGE) == (1, 0, 0) and h > 0 and w > 0
    assert got["pixel_values"].data.shape == (t * h * w, 1176)
    assert got["pixel_values"].data.dtype == torch.bfloat16
    assert got["image_grid_thw"].data.dtype == torch.int64
    assert item.length == t * h * w // MERGE**2 and set(prompt[1:-1]) == {IMAGE_PAD}


def test_a_size_the_processor_refuses_is_left_out_while_three_remain():
    from gateway.vllm.multimodal import _each_size

    def probe(w: int, h: int):
        if w < 100:
            raise ValueError(f"{w} px is too narrow")
        return (w, h)

    assert _each_size([(300, 200), (50, 200), (200, 300), (100, 100)], probe) == [
        (300, 200), (200, 300), (100, 100)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="refused the probe images.*50x200: 50 px is too narrow"):
        _each_size([(300, 200), (50, 200), (40, 40)], probe)


@pytest.fixture(scope="module")
def tiles_schema(schema):
    """Qwen2-VL's schema with the content rule of a model that drops all-zero rows as
    padding (Idefics3's, on its tiles): the rule is checked on any schema that carries it."""
    import copy

    marked = copy.deepcopy(schema)
    marked.keys["pixel_values"].nonzero_rows = True
    return marked


_ROW_KINDS = ["noise", "noise", "zero", "minus_zero", "one_value"]


@st.composite
def items_by_content(draw):
    """One valid 2x2-grid item (4 rows of pixels), each row noise, all +0.0 or -0.0, or
    zero but for one element; a placeholder range of pads and text tokens with any mask
    that marks one position per embedding."""
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    kinds = draw(st.lists(st.sampled_from(_ROW_KINDS), min_size=4, max_size=4))
    rows = []
    for kind in kinds:
        row = torch.zeros(1176)
        if kind == "noise":
            row = torch.rand(1176) + 0.1
        elif kind == "minus_zero":
            row = -row
        elif kind == "one_value":
            row[draw(st.integers(0, 1175))] = draw(st.sampled_from([-2.0, 0.5]))
        rows.append(row)
    pixels = torch.stack(rows).to(getattr(torch, dtype))
    range_tokens = draw(st.lists(st.sampled_from([IMAGE_PAD, 7]), min_size=1, max_size=4))
    marked = draw(st.sets(st.integers(0, len(range_tokens) - 1), min_size=1, max_size=1))
    mask = [i in marked for i in range(len(range_tokens))]
    tensors = {
        "pixel_values": to_wire_tensor(pixels),
        "image_grid_thw": to_wire_tensor(torch.tensor([1, 2, 2])),
    }
    prompt = [VISION_START, *range_tokens, VISION_END]
    item = MultimodalItem("image", "content", 1, len(range_tokens), mask, tensors)
    return prompt, item, kinds


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=items_by_content())
def test_item_contents_decide_by_rule_an_all_zero_row_or_a_mask_off_the_placeholders(
    tiles_schema, case
):
    """Refused exactly when a row is all zeros (either sign) or the mask is not the range's
    placeholder tokens, naming the first such row or position; the client's check agrees."""
    prompt, item, kinds = case
    zero_rows = [i for i, kind in enumerate(kinds) if kind in ("zero", "minus_zero")]
    placeholders = [i for i in range(item.length) if prompt[1 + i] == IMAGE_PAD]
    good_mask = placeholders == [i for i, m in enumerate(item.is_embed) if m]
    model = ModelInfo("tiles", 4096, 151936, [151645], multimodal={"image": tiles_schema.wire()})
    predicted = item_problem(model, prompt, item)
    try:
        inputs_for(tiles_schema).build(prompt, [item], cache_salt="")
    except RequestRejected as refused:
        event("refused")
        assert predicted is not None, refused.message
        if zero_rows:
            assert f"tensors['pixel_values'][{zero_rows[0]}] is all zeros" in refused.message
        else:
            assert not good_mask
            assert "is_embed leaves it out" in refused.message or "not the model's placeholder" in (
                refused.message
            )
        return
    event("accepted")
    assert predicted is None and not zero_rows and good_mask
