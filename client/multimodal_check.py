"""A multimodal item checked against what the gateway says the model's processor makes
(``HelloAck.model.multimodal``, PROTOCOL.md §7.16), before it is sent: the same rules the
gateway applies, read from the wire schema alone (pyzmq + msgspec only: no torch).

    problem = item_problem(client.hello_ack.model, prompt, item)
    if problem: raise ValueError(problem)

Byte limits, placeholder order and hashes are checked by the gateway only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

from codec import (
    FLOATING_DTYPES,
    TENSOR_DTYPE_SIZES,
    ItemSchema,
    ModelInfo,
    MultimodalItem,
    Tensor,
    TensorSchema,
)

__all__ = ["item_problem"]

# struct formats (little-endian) and value ranges of the integer dtypes a Tensor may carry.
_INTEGERS = {
    "int64": ("q", -(2**63), 2**63 - 1),
    "int32": ("i", -(2**31), 2**31 - 1),
    "int16": ("h", -(2**15), 2**15 - 1),
    "int8": ("b", -128, 127),
    "uint8": ("B", 0, 255),
    "bool": ("?", 0, 1),
}


def item_problem(model: ModelInfo, prompt: Sequence[int], item: MultimodalItem) -> str | None:
    """Why the gateway would refuse ``item`` (with its tensors) in ``prompt`` by the model's
    item schema, or None when the schema allows it."""
    schema = model.multimodal.get(item.modality)
    if schema is None:
        return f"modality {item.modality!r} is not served (modalities: {model.modalities})"
    tensors = item.tensors or {}
    if set(tensors) != set(schema.tensors):
        return f"tensors must be exactly {sorted(schema.tensors)}, not {sorted(tensors)}"
    for name, tensor in tensors.items():
        size = TENSOR_DTYPE_SIZES.get(tensor.dtype)
        if size is None:
            return f"tensors[{name!r}].dtype {tensor.dtype!r} is not one the wire carries"
        if len(tensor.data) != size * math.prod(tensor.shape):
            return f"tensors[{name!r}].data does not hold shape {tensor.shape} of {tensor.dtype}"
    values: dict[str, list[int]] = {}
    for name, spec in schema.tensors.items():
        problem = _dtype_problem(name, tensors[name], spec)
        if problem:
            return problem
        if spec.values is not None:
            values[name] = _integers(tensors[name])
    for name, spec in schema.tensors.items():
        problem = _shape_problem(name, tensors[name].shape, spec, values)
        if problem:
            return problem
        problem = _count_problem(name, values.get(name), spec)
        if problem:
            return problem
        problem = _zero_row_problem(name, tensors[name], spec) or _value_problem(
            name, tensors[name], spec
        )
        if problem:
            return problem
    return _embedding_problem(schema, prompt, item, values)


_CLEAR_SIGN = bytes(b & 0x7F for b in range(256))


def _zero_row_problem(name: str, tensor: Tensor, spec: TensorSchema) -> str | None:
    """An all-zero row where the model drops such rows (``nonzero_rows``), read from the
    bytes: an element is zero when its bits, less a floating sign bit, are all 0. (The
    gateway looks after the cast to the model's dtype, where a tiny float32 value may
    become 0 too: send what the model's processor makes.)"""
    if not spec.nonzero_rows or not tensor.shape or tensor.shape[0] == 0:
        return None
    size = TENSOR_DTYPE_SIZES[tensor.dtype]
    row_bytes = size * math.prod(tensor.shape[1:])
    data = bytearray(tensor.data)
    if tensor.dtype in FLOATING_DTYPES:  # little-endian: the sign is the last byte's top bit
        data[size - 1 :: size] = data[size - 1 :: size].translate(_CLEAR_SIGN)
    for row in range(tensor.shape[0]):
        if not any(data[row * row_bytes : (row + 1) * row_bytes]):
            return f"tensors[{name!r}][{row}] is all zeros; the model drops such rows"
    return None


# struct formats of the floating dtypes (bfloat16: read as float32, once widened).
_FLOAT_FORMATS = {"float64": "d", "float32": "f", "float16": "e", "bfloat16": "f"}


def _value_problem(name: str, tensor: Tensor, spec: TensorSchema) -> str | None:
    """A floating value that is NaN, an infinity or outside the schema's ``value_range``
    (compared as sent, before the gateway's cast to the model's dtype, as it compares)."""
    if spec.value_range is None or tensor.dtype not in FLOATING_DTYPES or not tensor.data:
        return None
    values = _floats(tensor)
    low, high = spec.value_range
    total = sum(values)  # NaN or an infinity when any value is one
    if math.isfinite(total) and low <= min(values) and max(values) <= high:
        return None
    return f"tensors[{name!r}] holds NaN, an infinity or a value outside [{low}, {high}]"


def _floats(tensor: Tensor) -> tuple[float, ...]:
    data, fmt = bytes(tensor.data), _FLOAT_FORMATS[tensor.dtype]
    if tensor.dtype == "bfloat16":  # the upper half of a float32, little-endian
        wide = bytearray(2 * len(data))
        wide[2::4], wide[3::4] = data[0::2], data[1::2]
        data = bytes(wide)
    return struct.unpack(f"<{len(data) // struct.calcsize(fmt)}{fmt}", data)


def _dtype_problem(name: str, tensor: Tensor, spec: TensorSchema) -> str | None:
    if (tensor.dtype in FLOATING_DTYPES) != (spec.dtype in FLOATING_DTYPES):
        return f"tensors[{name!r}] is {tensor.dtype}; the model takes {spec.dtype}"
    if tensor.dtype not in FLOATING_DTYPES and tensor.dtype != spec.dtype:
        low, high = _INTEGERS[spec.dtype][1:]
        if any(not low <= v <= high for v in _integers(tensor)):
            return f"tensors[{name!r}] holds values {spec.dtype} cannot hold"
    return None


def _shape_problem(
    name: str, shape: list[int], spec: TensorSchema, values: dict[str, list[int]]
) -> str | None:
    if len(shape) != len(spec.dims):
        return f"tensors[{name!r}] has shape {shape}; the model takes {len(spec.dims)} dims"
    for dim, (size, want) in enumerate(zip(shape, spec.dims, strict=True)):
        expected = want if isinstance(want, int) else math.prod(values.get(want, [-1]))
        if size != expected:
            return f"dim {dim} of tensors[{name!r}] is {size}; the model says {expected}"
    return None


def _count_problem(name: str, got: list[int] | None, spec: TensorSchema) -> str | None:
    if got is None:
        return None
    if len(got) != len(spec.values or []):
        return f"tensors[{name!r}] holds {len(got)} values; the model's hold {len(spec.values)}"
    for index, (value, pinned) in enumerate(zip(got, spec.values or [], strict=True)):
        if pinned is not None and value != pinned:
            return f"tensors[{name!r}][{index}] is {value}; it must be {pinned}"
    for index, (value, divisor) in enumerate(zip(got, spec.multiple_of or [], strict=False)):
        if value % divisor:
            return f"tensors[{name!r}][{index}] is {value}, not a multiple of {divisor}"
    return None


def _embedding_problem(
    schema: ItemSchema, prompt: Sequence[int], item: MultimodalItem, values: dict[str, list[int]]
) -> str | None:
    rule = schema.embeddings
    if rule.count is None:
        embeddings = rule.factor
    else:
        counts = values.get(rule.count, [])
        if any(v <= 0 for v in counts):
            return f"tensors[{rule.count!r}] must be positive"
        product = math.prod(counts)
        if rule.divide and product % rule.factor:
            return f"tensors[{rule.count!r}] make no whole number of embeddings"
        embeddings = product // rule.factor if rule.divide else product * rule.factor
    mask = item.is_embed
    if mask is not None and len(mask) != item.length:
        return f"is_embed has {len(mask)} entries; length is {item.length}"
    positions = range(item.offset, item.offset + item.length)
    embed_at = [p for i, p in enumerate(positions) if mask is None or mask[i]]
    if len(embed_at) != embeddings:
        return f"its tensors make {embeddings} embeddings; its placeholder marks {len(embed_at)}"
    tokens = set(schema.placeholder_tokens)
    wrong = next((p for p in embed_at if p >= len(prompt) or prompt[p] not in tokens), None)
    if wrong is not None:
        return f"prompt position {wrong} does not hold the placeholder token {sorted(tokens)}"
    # vLLM keys cached blocks by the item's content id and offset, not by its mask: the
    # embeddings must go exactly where the range's placeholder tokens are.
    placeholders = [p for p in positions if p < len(prompt) and prompt[p] in tokens]
    if placeholders != embed_at:
        first = next(p for p in placeholders if p not in embed_at)
        return f"prompt position {first} holds the placeholder token; is_embed leaves it out"
    return None


def _integers(tensor: Tensor) -> list[int]:
    fmt = _INTEGERS[tensor.dtype][0]
    count = math.prod(tensor.shape)
    return [int(v) for v in struct.unpack(f"<{count}{fmt}", tensor.data)]
