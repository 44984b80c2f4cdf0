"""Multimodal items into vLLM: what the model's processor makes, learned at start-up, and
each client item checked against it and built into vLLM's ``MultiModalKwargsItem``.

Owns: the probe of vLLM's own multimodal processor on images of several sizes (tensor names,
dtypes, ranks, the dims that never change, which counts the others follow, the tokens a
placeholder embeds at, how many embeddings an item fills, and the range floating values lie
in); the checks of a client's processed item against that (anything else would fail inside
the engine, for every client); and the ``mm_input`` vLLM's InputProcessor takes. The
processor itself never runs on a request. Imports vLLM and torch; only this package does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from codec import (
    FLOATING_DTYPES,
    EmbeddingRule,
    ErrorCode,
    ItemSchema,
    MultimodalItem,
    TensorSchema,
)

from ..errors import RequestRejected

logger = logging.getLogger(__name__)

__all__ = ["ModalitySchema", "MultimodalInputs", "probe_image_schema", "schema_from_probes"]


@dataclass(slots=True)
class _KeySpec:
    dtype: str  # torch's name, as the processor's output (floating: the model's dtype)
    ndim: int
    field: Any  # vLLM's field (batched / flat / shared) of the probed items
    fixed: dict[int, int] = field(default_factory=dict)  # dim -> size in every probe
    follows: dict[int, str] = field(default_factory=dict)  # dim -> count key it equals
    # A count tensor's elements: the same value in every probe (an image's temporal 1 in
    # Qwen-VL's image_grid_thw), or always a multiple (its spatial grid: of the merge size).
    pinned: dict[int, int] = field(default_factory=dict)  # element -> value
    multiple_of: dict[int, int] = field(default_factory=dict)  # element -> divisor
    elements: int | None = None  # a count tensor's elements (the same in every probe)
    nonzero_rows: bool = False  # the model drops an all-zero row (tile) as padding
    value_range: tuple[int, int] | None = None  # a floating tensor's values (_value_range)

    def wire(self) -> TensorSchema:
        dims: list[int | str] = [
            self.fixed[d] if d in self.fixed else self.follows[d] for d in range(self.ndim)
        ]
        value_range = None if self.value_range is None else list(self.value_range)
        if self.elements is None:
            return TensorSchema(
                self.dtype, dims, nonzero_rows=self.nonzero_rows, value_range=value_range
            )
        values = [self.pinned.get(i) for i in range(self.elements)]
        multiples = [self.multiple_of.get(i, 1) for i in range(self.elements)]
        return TensorSchema(
            self.dtype, dims, values, multiples, self.nonzero_rows, value_range=value_range
        )


@dataclass(slots=True)
class ModalitySchema:
    """What the model's processor makes for one item of ``modality``."""

    modality: str
    keys: dict[str, _KeySpec]
    placeholder_ids: frozenset[int]  # tokens at the embedding positions of a placeholder
    # Embeddings per item: ``scale`` x the product of ``count_key``'s values (``divide``:
    # divided instead), or ``scale`` alone without a count key.
    count_key: str | None
    scale: int
    divide: bool = False

    def wire(self) -> ItemSchema:
        """This schema as the wire's ``ModelInfo.multimodal`` says it."""
        return ItemSchema(
            {name: spec.wire() for name, spec in sorted(self.keys.items())},
            sorted(self.placeholder_ids),
            EmbeddingRule(self.count_key, self.scale, self.divide),
        )

    def embeds(self, values: dict[str, list[int]]) -> int | None:
        if self.count_key is None:
            return self.scale
        product = math.prod(values[self.count_key])
        if self.divide:
            return product // self.scale if product % self.scale == 0 else None
        return product * self.scale


def _count_values(tensors: dict[str, Any]) -> dict[str, list[int]]:
    """The integer tensors of up to 8 elements among ``tensors``: candidate counts (of a
    probed vLLM item's data, or of a client item's tensors)."""
    import torch

    return {
        name: [int(v) for v in t.flatten().tolist()]
        for name, t in tensors.items()
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel() <= 8
    }


# Content rules of the models vLLM serves, found by reading their code (vLLM 0.32): a
# model that looks at what a tensor holds, not only at its shape, and would fail inside the
# engine on values its processor never makes. Idefics3 (SmolVLM's architecture) drops every
# all-zero tile of ``pixel_values`` as padding, then splits the encoder's output by
# ``num_patches``: one such tile, and the split fails in the engine's step (ENGINE_DEAD).
# (No other model in vLLM 0.32 drops or selects by content: checked with
# ``grep -rn "pixel_values == 0\|== 0.0).sum" vllm/model_executor/models``.)
_ZERO_ROWS_DROPPED = {"Idefics3ForConditionalGeneration": ("pixel_values",)}


def _rows_dropped_when_zero(model_config: Any) -> tuple[str, ...]:
    """The tensors whose all-zero rows the served model drops (by its architecture, or an
    architecture vLLM implements with a subclass of one that does)."""
    names: list[str] = []
    for arch in getattr(model_config, "architectures", None) or []:
        for base, tensors in _ZERO_ROWS_DROPPED.items():
            if arch == base or _subclass_of(arch, base):
                names.extend(tensors)
    return tuple(dict.fromkeys(names))


def _subclass_of(arch: str, base: str) -> bool:
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        cls = ModelRegistry._try_load_model_cls(arch)
        return cls is not None and any(c.__name__ == base for c in cls.__mro__)
    except Exception:  # an unknown architecture: no rule known
        return False


def _check_rows(where: str, schema: ModalitySchema, tensors: dict) -> None:
    """Refuse an item with an all-zero row in a tensor the model drops such rows of."""
    for name, spec in schema.keys.items():
        tensor = tensors[name]
        if not spec.nonzero_rows or tensor.ndim == 0 or tensor.shape[0] == 0:
            continue
        zero = (tensor.reshape(tensor.shape[0], -1) == 0).all(dim=1).nonzero()
        if len(zero):
            raise RequestRejected(
                f"{where}: tensors[{name!r}][{int(zero[0])}] is all zeros; the model drops"
                " such rows as padding (its processor never makes one), and the item would"
                " no longer match its embeddings"
            )


def _check_values(where: str, name: str, tensor: Any, bounds: tuple[int, int]) -> None:
    """Refuse a floating tensor holding NaN, an infinity or a value outside ``bounds``: the
    model's activations turn NaN, and they stay in the request's KV-cache blocks, which
    vLLM hands to the next requests once it ends (at once where a block has no prefix hash):
    on the CPU engine, one such image turned other clients' greedy tokens into zeros,
    request after request."""
    if tensor.numel() == 0:
        return
    smallest, largest = (float(v) for v in tensor.aminmax())  # NaN if any is NaN
    low, high = bounds
    if low <= smallest and largest <= high:
        return
    held = (
        "NaN"
        if math.isnan(smallest) or math.isnan(largest)
        else f"values from {smallest:g} to {largest:g}"
    )
    raise RequestRejected(
        f"{where}: tensors[{name!r}] holds {held}; the model takes finite values within"
        f" [{low}, {high}] (value_range: its processor's, with a margin)"
    )


def _value_range(datas: Sequence[Any]) -> tuple[int, int] | None:
    """Whole-number bounds for a floating tensor's values: those the probes hold (black,
    white and noise images among them: the ends of the processor's normalisation), widened
    on each side by their span (at least 1). Any image the processor makes lies well
    inside; NaN, infinities and values thousands of times larger, which overflow inside the
    model, do not. None where the probes hold no values, or ones that are not finite."""
    values = [d for d in datas if d.numel()]
    if not values:
        return None
    low = min(float(d.min()) for d in values)
    high = max(float(d.max()) for d in values)
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    margin = max(high - low, abs(low), abs(high), 1.0)
    return math.floor(low - margin), math.ceil(high + margin)


def _probe_sizes(width: int, height: int) -> list[tuple[int, int]]:
    """Image sizes for the probe: the processor's largest dummy image, and smaller and
    differently shaped ones (ratios 1/3 to 1/7, so that no property of a count the sizes
    happen to share, such as a grid that is always a multiple of 4, is taken for a rule)."""
    ratios = [(1, 1), (1, 3), (3, 1), (4, 4), (5, 7), (7, 5)]
    return [(max(width // a, 1), max(height // b, 1)) for a, b in ratios]


def _probe_images(processor: Any) -> list[tuple[Any, Any, list[int]]]:
    """(vLLM item, placeholder, prompt ids) for images of several sizes, from the model's
    processor as vLLM runs it on a request."""
    from PIL import Image
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.multimodal.processing.processor import TimingContext

    model_config = processor.info.ctx.model_config
    mm_config = model_config.get_multimodal_config()
    options = mm_config.limit_per_prompt
    seq_len = model_config.max_model_len
    dummy = processor.get_dummy_inputs(seq_len, {"image": 1}, options)
    data = processor.dummy_inputs.get_dummy_mm_data(seq_len, {"image": 1}, options)
    image = data["image"]

    def probe(w: int, h: int, picture: Any = None) -> tuple[Any, Any, list[int]]:
        if picture is None:
            picture = Image.new("RGB", (w, h), color=(37 * w % 256, 91, 200))
        inputs = ProcessorInputs(
            prompt=list(dummy.prompt),
            mm_data_items=processor.info.parse_mm_data({"image": [picture]}),
            hf_processor_mm_kwargs=dummy.hf_processor_mm_kwargs,
        )
        out = processor.apply(inputs, timing_ctx=TimingContext(enabled=False))
        return (
            out["mm_kwargs"]["image"][0], out["mm_placeholders"]["image"][0],
            out["prompt_token_ids"],
        )  # fmt: skip

    sizes = _probe_sizes(*(image[0] if isinstance(image, list) else image).size)
    return _each_size(sizes, probe) + [probe(*sizes[0], p) for p in _range_images(sizes[0])]


def _range_images(size: tuple[int, int]) -> list[Any]:
    """Black, white and noise at the processor's own size: the ends of its pixel values'
    range, and content a processor that normalises per image spreads out."""
    import numpy as np
    from PIL import Image

    noise = np.random.RandomState(0).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    black, white = Image.new("RGB", size, (0, 0, 0)), Image.new("RGB", size, (255,) * 3)
    return [black, white, Image.fromarray(noise)]


def _each_size(sizes: Sequence[tuple[int, int]], probe: Any) -> list:
    """``probe(w, h)`` for each size. A size the processor refuses is left out (no client
    can send such an image either) while three or more remain; else ValueError."""
    probes, refused = [], []
    for w, h in sizes:
        try:
            probes.append(probe(w, h))
        except Exception as exc:  # the processor's own refusal, of any type
            refused.append(f"{w}x{h}: {exc}")
    if len(probes) < 3:
        raise ValueError(f"the processor refused the probe images ({'; '.join(refused)})")
    if refused:
        logger.info("image sizes the model's processor refused: %s", "; ".join(refused))
    return probes


def probe_image_schema(processor: Any) -> ModalitySchema:
    """Learn the image schema from vLLM's processor; ValueError if the items it makes do not
    follow one rule the gateway can check (then images are refused as UNSUPPORTED)."""
    return schema_from_probes("image", _probe_images(processor))


def schema_from_probes(
    modality: str, probes: Sequence[tuple[Any, Any, list[int]]]
) -> ModalitySchema:
    """The schema that every probe follows: ``probes`` are (vLLM ``MultiModalKwargsItem``,
    ``PlaceholderRange``, prompt ids) of one item each, from items of different sizes."""
    import torch

    items = [item for item, _, _ in probes]
    names = set(items[0])
    if any(set(item) != names for item in items):
        raise ValueError("the processor's items have different tensor names per image size")
    counts = [_count_values({k: e.data for k, e in item.items()}) for item in items]
    keys: dict[str, _KeySpec] = {}
    for name in sorted(names):
        datas = [item[name].data for item in items]
        if not all(isinstance(d, torch.Tensor) for d in datas):
            raise ValueError(f"{name!r} is not one tensor per item")
        dtype = str(datas[0].dtype).removeprefix("torch.")
        ndim = datas[0].dim()
        if any(str(d.dtype).removeprefix("torch.") != dtype or d.dim() != ndim for d in datas):
            raise ValueError(f"{name!r} changes dtype or rank with the image size")
        spec = _KeySpec(dtype, ndim, items[0][name].field)
        if dtype in FLOATING_DTYPES:
            spec.value_range = _value_range(datas)
        for dim in range(ndim):
            sizes = [d.shape[dim] for d in datas]
            if len(set(sizes)) == 1:
                spec.fixed[dim] = sizes[0]
                continue
            for count_key in sorted(counts[0]):
                if all(math.prod(c[count_key]) == s for c, s in zip(counts, sizes, strict=True)):
                    spec.follows[dim] = count_key
                    break
            else:
                raise ValueError(f"dim {dim} of {name!r} follows no count the item carries")
        keys[name] = spec
    embeds = [placeholder.get_num_embeds() for _, placeholder, _ in probes]
    placeholder_ids = set()
    for _, placeholder, prompt in probes:
        mask = placeholder.is_embed
        for i in range(placeholder.length):
            if mask is None or bool(mask[i]):
                placeholder_ids.add(prompt[placeholder.offset + i])
    rule = _embed_rule(embeds, counts)
    schema = ModalitySchema(modality, keys, frozenset(placeholder_ids), *rule)
    for name in set(counts[0]).intersection(*counts):
        _learn_count_elements(schema, name, [c[name] for c in counts])
    return schema


def _learn_count_elements(schema: ModalitySchema, name: str, values: list[list[int]]):
    """Pin the elements of count ``name`` that every probe gives the same value; where the
    embeddings are this count's product divided by ``scale``, each other element must be a
    multiple of what every probe's is (within ``scale``): Qwen-VL's vision tower folds its
    grid's height and width by the merge size, and an odd one fails inside the engine."""
    if len({len(v) for v in values}) != 1:
        return
    spec = schema.keys[name]
    spec.elements = len(values[0])
    divides = schema.divide and schema.count_key == name
    for index, column in enumerate(zip(*values, strict=True)):
        if len(set(column)) == 1:
            spec.pinned[index] = column[0]
        elif divides and (divisor := math.gcd(schema.scale, *column)) > 1:
            spec.multiple_of[index] = divisor


def _field(schema: ModalitySchema, name: str, tensor: Any) -> Any:
    """The probed item's field for ``name``; a flat field (pixel rows flat across a
    request's items) gets this item's own extent, as vLLM's processor gives an image alone."""
    from vllm.multimodal.inputs import MultiModalFlatField

    field = schema.keys[name].field
    if isinstance(field, MultiModalFlatField):
        extent = (slice(None),) * field.dim + (slice(0, tensor.shape[field.dim]),)
        return dataclasses.replace(field, slices=[extent])
    return field


def _embed_rule(embeds: list[int], counts: list[dict[str, list[int]]]) -> tuple:
    if len(set(embeds)) == 1:
        return None, embeds[0], False
    for key in sorted(counts[0]):
        products = [math.prod(c[key]) for c in counts]
        if all(p > 0 for p in products):
            if all(e % p == 0 for e, p in zip(embeds, products, strict=True)):
                scales = {e // p for e, p in zip(embeds, products, strict=True)}
                if len(scales) == 1:
                    return key, scales.pop(), False
            if all(p % e == 0 for e, p in zip(embeds, products, strict=True)):
                scales = {p // e for e, p in zip(embeds, products, strict=True)}
                if len(scales) == 1:
                    return key, scales.pop(), True
    raise ValueError(f"the embeddings per image ({embeds}) follow no count the item carries")


@dataclass(slots=True)
class MultimodalInputs:
    """Builds vLLM's ``mm_input`` from a Generate's resolved items (each with tensors, its
    ``hash`` the gateway's content id)."""

    schemas: dict[str, ModalitySchema]
    model_dtype: Any  # torch dtype floating tensors are cast to, as vLLM's processor does
    # Items per prompt and modality the engine was started for (--limit-mm-per-prompt):
    # vLLM's own frontend refuses more, and its encoder budget counts on it.
    per_prompt: dict[str, int] = field(default_factory=dict)

    @classmethod
    def for_model(cls, processor: Any, model_config: Any) -> MultimodalInputs:
        """The schemas of the modalities the gateway can check for this model (images)."""
        schemas = {}
        if "image" in processor.info.supported_mm_limits:
            try:
                schemas["image"] = probe_image_schema(processor)
            except Exception as exc:  # any failure means "cannot check"
                logger.warning("multimodal images are refused for this model: %s", exc)
            else:
                for name in _rows_dropped_when_zero(model_config):
                    if name in schemas["image"].keys:
                        schemas["image"].keys[name].nonzero_rows = True
        mm_config = getattr(model_config, "multimodal_config", None)
        per_prompt = {
            modality: mm_config.get_limit_per_prompt(modality)
            for modality in schemas
            if mm_config is not None
        }
        return cls(schemas, model_config.dtype, per_prompt)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(sorted(self.schemas))

    def wire_schemas(self) -> dict[str, ItemSchema]:
        """Per modality, what an item must be, as ``ModelInfo.multimodal`` says it."""
        return {modality: schema.wire() for modality, schema in sorted(self.schemas.items())}

    def build(self, prompt: Sequence[int], items: Sequence[MultimodalItem], cache_salt: str):
        """vLLM's ``mm_input`` for ``prompt`` with ``items``; RequestRejected naming the
        item and field when an item is not what the model's processor makes."""
        import torch
        from vllm.inputs.engine import mm_input
        from vllm.multimodal.inputs import (
            MultiModalFieldElem,
            MultiModalKwargsItem,
            MultiModalKwargsItems,
            PlaceholderRange,
        )

        kwargs: dict[str, list[Any]] = {}
        hashes: dict[str, list[str]] = {}
        placeholders: dict[str, list[Any]] = {}
        for modality, limit in self.per_prompt.items():
            count = sum(item.modality == modality for item in items)
            if count > limit:
                raise RequestRejected(
                    f"multimodal holds {count} {modality} items; the engine takes at most"
                    f" {limit} per prompt (--limit-mm-per-prompt)"
                )
        for index, item in enumerate(items):
            where = f"multimodal[{index}]"
            schema = self.schemas.get(item.modality)
            if schema is None:
                known = ", ".join(self.modalities) or "none"
                raise RequestRejected(
                    f"{where}: modality {item.modality!r} is not served by this model"
                    f" (modalities: {known})",
                    ErrorCode.UNSUPPORTED,
                )
            tensors = self._tensors(where, schema, item)
            values = _count_values(tensors)
            self._check_counts(where, schema, tensors, values)
            _check_rows(where, schema, tensors)
            mask = item.is_embed
            positions = range(item.offset, item.offset + item.length)
            embed_at = [p for i, p in enumerate(positions) if mask is None or mask[i]]
            expected = schema.embeds(values)
            if expected != len(embed_at):
                raise RequestRejected(
                    f"{where}: its tensors make {expected} embeddings, but its placeholder"
                    f" marks {len(embed_at)} positions (offset {item.offset}, length"
                    f" {item.length}, is_embed)"
                )
            wrong = next((p for p in embed_at if prompt[p] not in schema.placeholder_ids), None)
            if wrong is not None:
                raise RequestRejected(
                    f"{where}: prompt position {wrong} holds token {prompt[wrong]}, not the"
                    f" model's placeholder token ({sorted(schema.placeholder_ids)})"
                )
            # vLLM keys cached blocks by the item's content id and offset, not by its mask:
            # a mask shifted off the placeholder tokens would store KV under keys another
            # client's honest request computes. Embeddings go exactly where they are.
            placeholder_at = [p for p in positions if prompt[p] in schema.placeholder_ids]
            if placeholder_at != embed_at:
                skipped = next(p for p in placeholder_at if p not in embed_at)
                raise RequestRejected(
                    f"{where}: prompt position {skipped} holds the placeholder token but"
                    " is_embed leaves it out (the embedding positions must be exactly the"
                    " range's placeholder tokens, as the model's processor makes them)"
                )
            vllm_item = MultiModalKwargsItem(
                {
                    name: MultiModalFieldElem(data=tensor, field=_field(schema, name, tensor))
                    for name, tensor in tensors.items()
                }
            )
            kwargs.setdefault(item.modality, []).append(vllm_item)
            hashes.setdefault(item.modality, []).append(item.hash)
            is_embed = None if mask is None else torch.tensor(mask, dtype=torch.bool)
            placeholders.setdefault(item.modality, []).append(
                PlaceholderRange(offset=item.offset, length=item.length, is_embed=is_embed)
            )
        return mm_input(
            list(prompt),
            MultiModalKwargsItems(kwargs),
            hashes,
            placeholders,
            cache_salt=cache_salt,
        )

    def _tensors(self, where: str, schema: ModalitySchema, item: MultimodalItem) -> dict:
        import torch

        given = item.tensors or {}
        if set(given) != set(schema.keys):
            missing = sorted(set(schema.keys) - set(given))
            extra = sorted(set(given) - set(schema.keys))
            raise RequestRejected(
                f"{where}: tensors must be exactly {sorted(schema.keys)}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {extra}" if extra else "")
            )
        tensors = {}
        for name, wire in given.items():
            spec = schema.keys[name]
            floating = spec.dtype in FLOATING_DTYPES
            if floating != (wire.dtype in FLOATING_DTYPES):
                kind = "a floating dtype" if floating else "an integer or bool dtype"
                raise RequestRejected(
                    f"{where}: tensors[{name!r}].dtype is {wire.dtype}; the model takes {kind}"
                    f" ({spec.dtype})"
                )
            if len(wire.shape) != spec.ndim:
                raise RequestRejected(
                    f"{where}: tensors[{name!r}] has shape {wire.shape}; the model takes"
                    f" {spec.ndim} dims"
                )
            for dim, size in spec.fixed.items():
                if wire.shape[dim] != size:
                    raise RequestRejected(
                        f"{where}: tensors[{name!r}] has shape {wire.shape}; dim {dim} must"
                        f" be {size}"
                    )
            if len(wire.data) == 0:  # frombuffer refuses an empty buffer
                tensor = torch.empty(wire.shape, dtype=getattr(torch, wire.dtype))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a read-only view of the received frame
                    tensor = torch.frombuffer(wire.data, dtype=getattr(torch, wire.dtype))
                tensor = tensor.reshape(wire.shape) if wire.shape else tensor.reshape(())
            if floating:
                if spec.value_range is not None:
                    _check_values(where, name, tensor, spec.value_range)
                tensor = tensor.to(self.model_dtype)  # as vLLM casts the processor's outputs
            elif wire.dtype != spec.dtype:
                # A compact integer form (a 0/1 mask as uint8 or bool): widened, if lossless.
                cast = tensor.to(getattr(torch, spec.dtype))
                if not torch.equal(cast.to(tensor.dtype), tensor):
                    raise RequestRejected(
                        f"{where}: tensors[{name!r}] holds values {spec.dtype} cannot hold"
                    )
                tensor = cast
            tensors[name] = tensor
        return tensors

    @staticmethod
    def _check_counts(where: str, schema: ModalitySchema, tensors: dict, values: dict) -> None:
        for name, spec in schema.keys.items():
            got = values.get(name, [])
            for index, value in spec.pinned.items():
                if index >= len(got) or got[index] != value:
                    element = f"[{index}]" if spec.ndim else ""
                    raise RequestRejected(
                        f"{where}: tensors[{name!r}]{element} must be {value} for this model"
                    )
            for index, divisor in spec.multiple_of.items():
                if index < len(got) and got[index] % divisor:
                    raise RequestRejected(
                        f"{where}: tensors[{name!r}][{index}] is {got[index]}; the model's"
                        f" processor makes only multiples of {divisor}"
                    )
            for dim, count_key in spec.follows.items():
                count = math.prod(values.get(count_key, [-1]))
                if tensors[name].shape[dim] != count:
                    raise RequestRejected(
                        f"{where}: dim {dim} of tensors[{name!r}] is"
                        f" {tensors[name].shape[dim]}; tensors[{count_key!r}] says {count}"
                    )
        if schema.count_key is not None and any(v <= 0 for v in values[schema.count_key]):
            raise RequestRejected(f"{where}: tensors[{schema.count_key!r}] must be positive")
