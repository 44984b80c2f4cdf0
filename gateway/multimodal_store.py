"""Multimodal items held for resending by hash, and the wire checks every item gets.

Owns: the per-session memory of items a client sent with tensors (so it may name them by
``hash`` alone later: PROTOCOL.md §7.16), bounded in bytes (least recently used first);
the content id the engine sees (a digest of the tensors, never the client's hash, so that
no client can pass its tensors off under another's id in the engine's encoder cache); and
the checks that need no model: counts, byte limits, dtypes, shapes against byte lengths,
placeholder ranges inside the prompt. Model checks are the engine adapter's
(``gateway.vllm.multimodal``). Sans-IO: no sockets, no vLLM, no torch.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from codec import TENSOR_DTYPE_SIZES, ErrorCode, ItemSchema, MultimodalItem, Tensor

__all__ = [
    "ItemProblem",
    "MultimodalStore",
    "content_id",
    "isolated_id",
    "tensor_bytes",
]


@dataclass(frozen=True, slots=True)
class ItemProblem(Exception):
    """Why a Generate's multimodal items were refused: an ErrorCode and a message that
    names the item (by index and hash) and the field."""

    code: ErrorCode
    message: str


def tensor_bytes(items: Sequence[MultimodalItem]) -> int:
    """Bytes of tensor data in ``items``."""
    return sum(len(t.data) for item in items if item.tensors for t in item.tensors.values())


def content_id(item: MultimodalItem) -> str:
    """The id the engine caches this item's encoder output under: a digest of its modality
    and tensors (names, dtypes, shapes, bytes). Equal tensors, equal ids, whoever sent them."""
    digest = hashlib.blake2b(item.modality.encode(), digest_size=16)
    for name in sorted(item.tensors or {}):
        t = (item.tensors or {})[name]
        digest.update(msgspec.msgpack.encode((name, t.dtype, t.shape)))
        digest.update(t.data)
    return "eg-" + digest.hexdigest()


def isolated_id(tenant: str, item_id: str) -> str:
    """An item's id under cache isolation: its content id keyed by the client it came from,
    so that no other client's request finds its encoder output cached (vLLM keys the
    encoder cache, and an item's KV blocks, by this id)."""
    digest = hashlib.blake2b(f"{tenant}\0{item_id}".encode(), digest_size=16)
    return "eg-" + digest.hexdigest()


def _name(index: int, item: MultimodalItem) -> str:
    return f"multimodal[{index}] (hash {item.hash!r})"


def _check_tensor(where: str, name: str, tensor: Tensor, item_limit: int) -> None:
    size = TENSOR_DTYPE_SIZES.get(tensor.dtype)
    if size is None:
        raise ItemProblem(
            ErrorCode.INVALID_REQUEST,
            f"{where}: tensors[{name!r}].dtype {tensor.dtype!r} is not one of"
            f" {', '.join(TENSOR_DTYPE_SIZES)}",
        )
    count = math.prod(tensor.shape)  # at most 16 dims (the codec): a small big int at worst
    if count * size > item_limit:
        raise ItemProblem(
            ErrorCode.INVALID_REQUEST,
            f"{where}: tensors[{name!r}] of shape {tensor.shape} exceeds"
            f" max_multimodal_item_bytes ({item_limit})",
        )
    if len(tensor.data) != count * size:
        raise ItemProblem(
            ErrorCode.INVALID_REQUEST,
            f"{where}: tensors[{name!r}].data holds {len(tensor.data)} bytes; shape"
            f" {tensor.shape} of {tensor.dtype} needs {count * size}",
        )


def _owned(item: MultimodalItem) -> MultimodalItem:
    """``item`` with tensors of its own: received ones are views into their whole frame, which
    would keep every other item and the prompt of that frame alive (and out of the count)."""
    tensors = {
        name: Tensor(t.dtype, t.shape, memoryview(bytes(t.data)))
        for name, t in (item.tensors or {}).items()
    }
    # Only what a use by hash takes (its modality, content id and tensors): the placeholder
    # mask of the request that sent it (8 bytes a position) stays out of the held bytes.
    return msgspec.structs.replace(item, tensors=tensors, is_embed=None)


@dataclass(slots=True)
class _Entry:
    item: MultimodalItem  # tensors present, hash = content id
    nbytes: int


@dataclass(slots=True)
class StoreStats:
    items: int = 0  # items of accepted requests
    item_bytes: int = 0  # tensor bytes received in accepted requests
    items_by_hash: int = 0  # items named by hash alone (tensors from the store)
    unknown_hashes: int = 0  # hash-only items refused: MULTIMODAL_ITEM_UNKNOWN
    evictions: int = 0


class MultimodalStore:
    """Items per session, bounded by ``capacity_bytes`` in all (0: nothing held, so
    every item must carry its tensors)."""

    def __init__(
        self,
        capacity_bytes: int,
        max_items: int,
        max_item_bytes: int,
        max_request_bytes: int,
        schemas: Mapping[str, ItemSchema] | None = None,
    ):
        """``schemas``: per modality, the dtypes the engine holds each tensor in (integer
        ones are widened to the processor's, floating ones cast to the model's)."""
        self.schemas = dict(schemas or {})
        self.capacity_bytes = capacity_bytes
        self.max_items = max_items
        self.max_item_bytes = max_item_bytes
        self.max_request_bytes = max_request_bytes
        self._entries: OrderedDict[tuple[int, str], _Entry] = OrderedDict()
        self._sessions: dict[int, set[str]] = {}
        self.held_bytes = 0
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self._entries)

    def resolve(
        self, session_id: int, items: Sequence[MultimodalItem], prompt_len: int
    ) -> list[MultimodalItem]:
        """``items`` checked, each with its tensors (from the store, or an earlier item of
        this request, when named by hash) and its content id as ``hash``; raises
        ItemProblem. Nothing is stored here: call
        ``remember`` once the request is accepted."""
        if len(items) > self.max_items:
            raise ItemProblem(
                ErrorCode.INVALID_REQUEST,
                f"multimodal holds {len(items)} items; max_multimodal_items is {self.max_items}",
            )
        total = tensor_bytes(items)
        if total > self.max_request_bytes:
            raise ItemProblem(
                ErrorCode.INVALID_REQUEST,
                f"multimodal tensors hold {total} bytes; max_multimodal_request_bytes is"
                f" {self.max_request_bytes}",
            )
        resolved = []
        in_request: dict[str, _Entry] = {}  # items with tensors earlier in this request
        end = -1
        for index, item in enumerate(items):
            where = _name(index, item)
            if item.offset + item.length > prompt_len:
                raise ItemProblem(
                    ErrorCode.INVALID_REQUEST,
                    f"{where}: offset {item.offset} + length {item.length} is past the"
                    f" prompt's {prompt_len} tokens",
                )
            if item.offset <= end:
                raise ItemProblem(
                    ErrorCode.INVALID_REQUEST,
                    f"{where}: offset {item.offset} overlaps the previous item's"
                    f" placeholder (items in prompt order, placeholders apart)",
                )
            end = item.offset + item.length - 1
            if item.is_embed is not None:
                if len(item.is_embed) != item.length:
                    raise ItemProblem(
                        ErrorCode.INVALID_REQUEST,
                        f"{where}: is_embed has {len(item.is_embed)} entries; length is"
                        f" {item.length}",
                    )
                if not any(item.is_embed):
                    raise ItemProblem(
                        ErrorCode.INVALID_REQUEST, f"{where}: is_embed marks no position"
                    )
            if item.tensors is None:
                # An earlier item of this request first (§7.16), then the session's held one.
                entry = in_request.get(item.hash) or self._entries.get((session_id, item.hash))
                if entry is None:
                    self.stats.unknown_hashes += 1
                    raise ItemProblem(
                        ErrorCode.MULTIMODAL_ITEM_UNKNOWN,
                        f"{where} has no tensors, and this session has not sent an item"
                        " with that hash (or it was evicted): send it again with its"
                        " tensors",
                    )
                if entry.item.modality != item.modality:
                    raise ItemProblem(
                        ErrorCode.INVALID_REQUEST,
                        f"{where}: modality {item.modality!r}, but that hash was sent as"
                        f" {entry.item.modality!r}",
                    )
                if item.hash not in in_request:
                    self._entries.move_to_end((session_id, item.hash))
                resolved.append(
                    msgspec.structs.replace(
                        entry.item,
                        offset=item.offset,
                        length=item.length,
                        is_embed=item.is_embed,
                    )
                )
                continue
            if not item.tensors:
                raise ItemProblem(ErrorCode.INVALID_REQUEST, f"{where}: tensors is empty")
            nbytes = tensor_bytes([item])
            if nbytes > self.max_item_bytes:
                raise ItemProblem(
                    ErrorCode.INVALID_REQUEST,
                    f"{where}: tensors hold {nbytes} bytes; max_multimodal_item_bytes is"
                    f" {self.max_item_bytes}",
                )
            for name, tensor in item.tensors.items():
                _check_tensor(where, name, tensor, self.max_item_bytes)
            full = msgspec.structs.replace(item, hash=content_id(item))
            in_request[item.hash] = _Entry(full, nbytes)
            resolved.append(full)
        # Items by hash count too, and tensors as wide as the engine holds them.
        engine_bytes = self.engine_bytes(resolved)
        if engine_bytes > self.max_request_bytes:
            raise ItemProblem(
                ErrorCode.INVALID_REQUEST,
                f"multimodal tensors hold {engine_bytes} bytes as the engine takes them"
                " (items named by hash included, integer tensors widened to the model's"
                f" dtype); max_multimodal_request_bytes is {self.max_request_bytes}",
            )
        return resolved

    def engine_bytes(self, items: Sequence[MultimodalItem]) -> int:
        """Bytes of the tensors of resolved ``items`` as the engine holds them: each at
        least as received, and more where the model's dtype is wider (a 0/1 mask sent as
        ``uint8`` for an ``int64`` tensor takes 8 bytes an element)."""
        total = 0
        for item in items:
            schema = self.schemas.get(item.modality)
            for name, tensor in (item.tensors or {}).items():
                received = len(tensor.data)
                spec = schema.tensors.get(name) if schema is not None else None
                if spec is None or spec.dtype not in TENSOR_DTYPE_SIZES:
                    total += received
                    continue
                elements = received // TENSOR_DTYPE_SIZES[tensor.dtype]
                total += max(received, elements * TENSOR_DTYPE_SIZES[spec.dtype])
        return total

    def remember(
        self,
        session_id: int,
        sent: Sequence[MultimodalItem],
        resolved: Sequence[MultimodalItem],
    ) -> None:
        """An accepted request's items: those sent with tensors are held under the client's
        hash for this session; counts for the metrics."""
        stats = self.stats
        for item, full in zip(sent, resolved, strict=True):
            stats.items += 1
            if item.tensors is None:
                stats.items_by_hash += 1
                continue
            nbytes = tensor_bytes([full])
            stats.item_bytes += nbytes
            key = (session_id, item.hash)
            old = self._entries.pop(key, None)  # that hash names these tensors from now on
            if old is not None:
                self.held_bytes -= old.nbytes
                self._sessions[session_id].discard(item.hash)
            if nbytes > self.capacity_bytes:
                continue  # too big to hold: a later use by hash is MULTIMODAL_ITEM_UNKNOWN
            self._entries[key] = _Entry(_owned(full), nbytes)
            self._sessions.setdefault(session_id, set()).add(item.hash)
            self.held_bytes += nbytes
        while self.held_bytes > self.capacity_bytes and self._entries:
            (session, hash_), entry = self._entries.popitem(last=False)
            self.held_bytes -= entry.nbytes
            self._sessions[session].discard(hash_)
            stats.evictions += 1

    def drop_session(self, session_id: int) -> None:
        """The session ended: its items go (a new session starts with none)."""
        for hash_ in self._sessions.pop(session_id, ()):
            entry = self._entries.pop((session_id, hash_), None)
            if entry is not None:
                self.held_bytes -= entry.nbytes
