"""The multimodal store and its wire checks (sans-IO), alone and inside the session table."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from codec import Error, ErrorCode, Generate, Hello, MultimodalItem, Tensor
from gateway.multimodal_store import ItemProblem, MultimodalStore, content_id
from gateway.sessions import GatewayLimits
from tests.helpers import FAKE_INFO, TableHarness

PROMPT = [1, 6, 6, 6, 6, 2, 6, 6, 6, 6, 3]


def item(hash_: str = "h1", offset: int = 1, fill: int = 0, size: int = 16, **kw) -> MultimodalItem:
    tensors = {"pixel_values": Tensor("float32", [size // 4], bytes([fill]) * size)}
    return MultimodalItem("image", hash_, offset, 4, tensors=tensors, **kw)


def bare(hash_: str = "h1", offset: int = 1) -> MultimodalItem:
    return MultimodalItem("image", hash_, offset, 4)


def store(capacity: int = 1 << 20, **kw) -> MultimodalStore:
    limits = dict(max_items=4, max_item_bytes=1024, max_request_bytes=2048) | kw
    return MultimodalStore(capacity, **limits)


def problem(s: MultimodalStore, items, session: int = 1, prompt=PROMPT) -> ItemProblem:
    with pytest.raises(ItemProblem) as caught:
        s.resolve(session, items, len(prompt))
    return caught.value


def test_the_engine_sees_a_digest_of_the_tensors_not_the_clients_hash():
    s = store()
    (a,) = s.resolve(1, [item("mine", fill=1)], len(PROMPT))
    (b,) = s.resolve(2, [item("yours", fill=1)], len(PROMPT))
    (c,) = s.resolve(2, [item("mine", fill=2)], len(PROMPT))
    assert a.hash == b.hash == content_id(item("x", fill=1)) and a.hash.startswith("eg-")
    assert c.hash != a.hash  # the same client hash with other tensors: another id
    assert bytes(a.tensors["pixel_values"].data) == bytes([1]) * 16


def test_an_item_is_held_per_session_and_named_by_hash_later():
    s = store()
    sent = [item("h1")]
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    (again,) = s.resolve(1, [bare("h1", offset=6)], len(PROMPT))
    assert again.offset == 6 and again.tensors is not None
    assert again.hash == content_id(item("h1"))
    unknown = problem(s, [bare("h1")], session=2)  # another session holds nothing
    assert unknown.code is ErrorCode.MULTIMODAL_ITEM_UNKNOWN
    assert "multimodal[0] (hash 'h1')" in unknown.message
    s.drop_session(1)
    assert s.held_bytes == 0 and len(s) == 0
    assert problem(s, [bare("h1")]).code is ErrorCode.MULTIMODAL_ITEM_UNKNOWN
    assert s.stats.unknown_hashes == 2


def test_a_held_item_owns_its_bytes_not_its_whole_frame():
    frame = bytes(range(256)) * 64  # a received frame: the tensors are views into it
    sent = [
        MultimodalItem(
            "image", "h1", 1, 4, tensors={"x": Tensor("uint8", [16], memoryview(frame)[100:116])}
        )
    ]
    s = store()
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    (held,) = s.resolve(1, [bare("h1")], len(PROMPT))
    data = held.tensors["x"].data
    assert bytes(data) == frame[100:116] and len(data.obj) == 16


def test_a_repeat_later_in_one_request_may_go_by_hash():
    s = store()
    first, second = s.resolve(1, [item("h1"), bare("h1", offset=6)], len(PROMPT))
    assert second.tensors is first.tensors and second.offset == 6


def test_least_recently_used_items_go_first():
    s = store(capacity=40)
    for name in ("a", "b"):
        sent = [item(name, size=16)]
        s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    s.resolve(1, [bare("a")], len(PROMPT))  # a is used again: b is older
    sent = [item("c", size=16)]
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    assert s.held_bytes == 32 and s.stats.evictions == 1
    s.resolve(1, [bare("a")], len(PROMPT))
    assert problem(s, [bare("b")]).code is ErrorCode.MULTIMODAL_ITEM_UNKNOWN


@pytest.mark.parametrize(
    ("items", "words"),
    [
        ([item(size=2048)], "max_multimodal_item_bytes"),
        ([item("a", 1, size=1024), item("b", 6, size=1024), item("c", 6)], "max_multimodal_req"),
        ([item()] * 5, "max_multimodal_items"),
        ([item(offset=8)], "past the prompt"),
        ([item(), item(offset=3)], "multimodal[1] (hash 'h1'): offset 3 overlaps"),
        ([item(is_embed=[True])], "is_embed has 1 entries"),
        ([item(is_embed=[False] * 4)], "is_embed marks no position"),
        ([msgspec.structs.replace(item(), tensors={})], "tensors is empty"),
        ([msgspec.structs.replace(item(), tensors={"x": Tensor("complex64", [1], b"")})],
         "'complex64' is not one of"),
        ([msgspec.structs.replace(item(), tensors={"x": Tensor("int64", [3], bytes(16))})],
         "holds 16 bytes; shape [3] of int64 needs 24"),
        ([msgspec.structs.replace(item(), tensors={"x": Tensor("int8", [1 << 20], b"")})],
         "exceeds max_multimodal_item_bytes"),
    ],
)  # fmt: skip
def test_malformed_items_are_refused_by_name(items, words):
    found = problem(store(), items)
    assert found.code is ErrorCode.INVALID_REQUEST
    assert words in found.message and "multimodal" in found.message


def test_a_modality_mismatch_by_hash_is_refused():
    s = store()
    sent = [item("h1")]
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    found = problem(s, [msgspec.structs.replace(bare("h1"), modality="audio")])
    assert "was sent as 'image'" in found.message


def _vlm_table(**limits) -> TableHarness:
    info = dataclasses.replace(FAKE_INFO, modalities=("image",))
    h = TableHarness(GatewayLimits(**limits), info)
    h.prepared = []
    prepare = h.table._prepare

    def recording(engine_request_id: str, request: Generate):
        h.prepared.append(request)
        return prepare(engine_request_id, request)

    h.table._prepare = recording
    return h


def test_the_table_holds_a_sessions_items_until_it_ends():
    h = _vlm_table()
    h.send(b"c1", Hello(1))
    ack = h.take(b"c1")
    assert ack[0].model.modalities == ["image"] and ack[0].limits.max_multimodal_items == 16
    h.send(b"c1", Generate("r1", PROMPT, multimodal=[bare("h1")]))
    (refusal,) = h.take(b"c1")
    assert isinstance(refusal, Error) and refusal.code is ErrorCode.MULTIMODAL_ITEM_UNKNOWN
    assert refusal.request_id == "r1" and not h.submitted
    h.send(b"c1", Generate("r1", PROMPT, multimodal=[item("h1")]))
    assert len(h.submitted) == 1 and h.take(b"c1") == []
    h.send(b"c1", Generate("r2", PROMPT, multimodal=[bare("h1", offset=6)]))
    assert len(h.submitted) == 2 and h.take(b"c1") == []
    assert h.prepared[-1].multimodal[0].tensors is not None  # the engine got them
    stats = h.table.gateway_stats()
    assert (stats["multimodal_items"], stats["multimodal_items_by_hash"]) == (2, 1)
    assert stats["multimodal_held_items"] == 1
    h.send(b"c1", Hello(1))  # a new session under the same identity holds nothing
    assert h.table.gateway_stats()["multimodal_held_items"] == 0


def test_a_refused_request_leaves_nothing_held():
    h = _vlm_table(max_prompt_tokens=8)
    h.send(b"c1", Hello(1))
    h.send(b"c1", Generate("r1", PROMPT, multimodal=[item("h1")]))  # prompt too long
    assert isinstance(h.take(b"c1")[-1], Error)
    assert h.table.gateway_stats()["multimodal_held_items"] == 0


def test_a_text_model_refuses_items_as_unsupported():
    h = TableHarness()
    h.send(b"c1", Hello(1))
    h.take(b"c1")
    h.send(b"c1", Generate("r1", PROMPT, multimodal=[item()]))
    (refusal,) = h.take(b"c1")
    assert refusal.code is ErrorCode.UNSUPPORTED and "takes no multimodal items" in refusal.message
    assert h.table.wire_limits.max_multimodal_items == 0
