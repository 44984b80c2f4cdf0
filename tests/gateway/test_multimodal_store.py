"""The multimodal store and its wire checks (sans-IO), alone and inside the session table."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from codec import (
    EmbeddingRule,
    Error,
    ErrorCode,
    Generate,
    Hello,
    ItemSchema,
    MultimodalItem,
    Overloaded,
    Tensor,
    TensorSchema,
)
from gateway.fake_engine import FakeOutput
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


# Any schema: the fake engine checks nothing; the table passes it on in HelloAck.
IMAGE = ItemSchema({"pixel_values": TensorSchema("float32", ["n"])}, [6], EmbeddingRule(None, 4))


def _vlm_table(**limits) -> TableHarness:
    info = dataclasses.replace(FAKE_INFO, multimodal={"image": IMAGE})
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
    assert ack[0].model.multimodal == {"image": IMAGE}
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


_SIZES = {"float32": 4, "bfloat16": 2, "int64": 8, "uint8": 1, "bool": 1}


@st.composite
def wire_requests(draw):
    """A request's items as a client would send them, in prompt order, apart, each with
    tensors or a hash alone (hashes from a small set, so some are held and some are not);
    now and then one thing wrong: a dtype name, a byte length, a placeholder out of place
    or past the prompt, an is_embed mask, an empty tensors map."""
    items, offset = [], draw(st.integers(0, 2))
    for _ in range(draw(st.integers(0, 4))):
        wrong = draw(st.sampled_from([None] * 6 + ["dtype", "bytes", "overlap", "mask", "empty"]))
        dtype = "complex64" if wrong == "dtype" else draw(st.sampled_from(sorted(_SIZES)))
        shape = draw(st.lists(st.integers(0, 40), max_size=3))
        nbytes = _SIZES.get(dtype, 8) * math.prod(shape) + (wrong == "bytes")
        tensors = {"pixel_values": Tensor(dtype, shape, bytes(nbytes))}
        tensors = {} if wrong == "empty" else draw(st.sampled_from([None, tensors, tensors]))
        length = draw(st.integers(1, 3))
        mask = draw(st.none() | st.lists(st.booleans(), min_size=length, max_size=length))
        if wrong == "mask":
            mask = [False] * length if draw(st.booleans()) else [True] * (length + 1)
        # "overlap": on the previous item's last position.
        at = items[-1].offset + items[-1].length - 1 if wrong == "overlap" and items else offset
        hash_ = draw(st.sampled_from(["a", "b", "c"]))
        items.append(MultimodalItem("image", hash_, at, length, mask, tensors))
        offset = at + length + draw(st.integers(0, 2))
    return items


def expected_refusal(items, held: dict, prompt_len: int, max_item: int, max_request: int):
    """The store's rules, written out on their own: None where ``items`` must be accepted
    (``held``: hash -> bytes of the items the session holds), else (code, a fragment the
    message must hold: the first item that breaks a rule, or the request limit)."""
    invalid, unknown = ErrorCode.INVALID_REQUEST, ErrorCode.MULTIMODAL_ITEM_UNKNOWN
    sent = sum(len(t.data) for item in items for t in (item.tensors or {}).values())
    if sent > max_request:
        return invalid, "max_multimodal_request_bytes"
    end, earlier, total = -1, {}, 0
    for index, item in enumerate(items):
        where = f"multimodal[{index}]"
        if item.offset + item.length > prompt_len or item.offset <= end:
            return invalid, where
        end = item.offset + item.length - 1
        mask = item.is_embed
        if mask is not None and (len(mask) != item.length or not any(mask)):
            return invalid, where
        if item.tensors is None:
            nbytes = earlier.get(item.hash, held.get(item.hash))
            if nbytes is None:
                return unknown, where
            total += nbytes
            continue
        if not item.tensors:
            return invalid, where
        nbytes = sum(len(t.data) for t in item.tensors.values())
        for t in item.tensors.values():
            size = _SIZES.get(t.dtype)
            if size is None or len(t.data) != size * math.prod(t.shape) or nbytes > max_item:
                return invalid, where
        earlier[item.hash] = nbytes
        total += nbytes
    return (invalid, "max_multimodal_request_bytes") if total > max_request else None


@settings(max_examples=400, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 3), wire_requests(), st.booleans()),
        max_size=12,
    )
)
def test_any_items_resolve_within_their_checks_or_are_refused_by_name(requests):
    """Requests from three sessions (some sessions ending): every resolve either refuses with
    a message naming the item or limit, or gives items that pass every wire check, each
    with its tensors and a content id; the held bytes stay within capacity and add up."""
    s = store(capacity=4096, max_item_bytes=1024, max_request_bytes=2048)
    accepted = 0
    for session, items, ends in requests:
        held = {h: e.nbytes for (owner, h), e in s._entries.items() if owner == session}
        expected = expected_refusal(items, held, len(PROMPT), 1024, 2048)
        try:
            resolved = s.resolve(session, items, len(PROMPT))
        except ItemProblem as refused:
            # Refused for the right reason: the rule, and the first item, that breaks.
            assert expected is not None, f"wrongly refused: {refused.message}"
            code, fragment = expected
            assert refused.code is code and fragment in refused.message, refused.message
        else:
            assert expected is None, f"accepted, but should be refused: {expected}"
            end = -1
            for sent, got in zip(items, resolved, strict=True):
                assert got.tensors and got.hash == content_id(got) and got.modality == sent.modality
                assert (got.offset, got.length, got.is_embed) == (
                    sent.offset,
                    sent.length,
                    sent.is_embed,
                )
                assert end < got.offset and got.offset + got.length <= len(PROMPT)
                end = got.offset + got.length - 1
                assert sent.is_embed is None or (
                    len(sent.is_embed) == sent.length and any(sent.is_embed)
                )
                for t in got.tensors.values():
                    assert len(t.data) == _SIZES[t.dtype] * math.prod(t.shape) <= 1024
            s.remember(session, items, resolved)
            accepted += 1
        if ends:
            s.drop_session(session)
        assert 0 <= s.held_bytes <= 4096
        assert s.held_bytes == sum(e.nbytes for e in s._entries.values())
    event(f"accepted {min(accepted, 3)}+")


def test_a_held_item_keeps_no_placeholder_mask_and_a_hash_too_big_to_hold_forgets_the_old():
    """Issue 51 items 12 and 15: the first request's is_embed (8 bytes a position, outside
    the count) is not held; an item under a held hash that is too big to hold replaces it
    (a later use by hash must not get the old tensors); within a request, a hash names the
    request's own earlier item before the store's."""
    s = store(capacity=64)
    sent = [item("h1", fill=1, is_embed=[True, False, True, True])]
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    assert next(iter(s._entries.values())).item.is_embed is None
    bigger = [item("h1", fill=2, size=128)]  # within max_item_bytes, over the capacity
    s.remember(1, bigger, s.resolve(1, bigger, len(PROMPT)))
    assert s.held_bytes == 0
    assert problem(s, [bare("h1")]).code is ErrorCode.MULTIMODAL_ITEM_UNKNOWN
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))  # h1 held: fill 1
    newer, again = s.resolve(1, [item("h1", fill=3), bare("h1", offset=6)], len(PROMPT))
    assert bytes(again.tensors["pixel_values"].data) == bytes([3]) * 16


def test_items_named_by_hash_count_against_the_request_bytes():
    """Issue 51 item 14: 16 items of 32 MiB by hash once reached one engine request."""
    s = store(max_item_bytes=64, max_request_bytes=64)
    sent = [item("h1", size=48)]
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    refused = problem(s, [bare("h1"), bare("h1", offset=6)])
    assert "96 bytes as the engine takes them" in refused.message
    (alone,) = s.resolve(1, [bare("h1")], len(PROMPT))
    assert alone.tensors is not None


def test_the_boundaries_that_mutants_moved_unseen():
    """Issue 51's surviving mutants: each boundary tried from both sides."""
    s = store(max_items=2, max_item_bytes=32, max_request_bytes=64)
    # An item may end exactly at the prompt's end; one token past is refused.
    end = len(PROMPT) - 4
    assert s.resolve(1, [item("e", offset=end)], len(PROMPT))
    assert "past the prompt" in problem(s, [item("e", offset=end + 1)]).message
    # max_items items are fine, one more is not.
    assert len(s.resolve(1, [item("a"), item("b", offset=6)], len(PROMPT))) == 2
    three = [item("a"), item("b", offset=6), item("c", offset=11)]
    assert "max_multimodal_items is 2" in problem(s, three, prompt=PROMPT + [6] * 8).message
    # Exactly max_item_bytes is fine, one element more is not.
    assert s.resolve(1, [item("x", size=32)], len(PROMPT))
    assert "max_multimodal_item_bytes is 32" in problem(s, [item("x", size=36)]).message
    # A mask that marks some positions (not all) is fine.
    assert s.resolve(1, [item("m", is_embed=[False, True, True, False])], len(PROMPT))


def test_the_content_id_covers_modality_dtype_and_shape_not_only_bytes():
    base = item("h", fill=7)
    t = base.tensors["pixel_values"]
    others = [
        msgspec.structs.replace(base, modality="video"),
        msgspec.structs.replace(base, tensors={"pixel_values": Tensor("int32", t.shape, t.data)}),
        msgspec.structs.replace(base, tensors={"pixel_values": Tensor(t.dtype, [2, 2], t.data)}),
        msgspec.structs.replace(base, tensors={"other": t}),
    ]
    ids = {content_id(x) for x in [base, *others]}
    assert len(ids) == 5


def test_an_evicted_item_leaves_its_sessions_set_and_one_over_capacity_is_never_held():
    s = store(capacity=32)
    for name in ("a", "b"):
        sent = [item(name)]
        s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))
    sent = [item("c")]
    s.remember(1, sent, s.resolve(1, sent, len(PROMPT)))  # evicts "a" (16 + 16 + 16 > 32)
    assert s._sessions[1] == {"b", "c"} and s.held_bytes == 32
    huge = [item("z", size=64)]
    s.remember(1, huge, s.resolve(1, huge, len(PROMPT)))
    assert "z" not in s._sessions[1] and s.held_bytes == 32


def test_a_narrow_integer_tensor_counts_as_wide_as_the_engine_holds_it():
    """Issue 51 item 14: a 0/1 mask sent as uint8 for an int64 tensor takes 8x in the
    engine; the request bound counts what the engine holds, never less than received."""
    schema = ItemSchema(
        {"mask": TensorSchema("int64", ["n"]), "pixel_values": TensorSchema("bfloat16", ["n"])},
        [6],
        EmbeddingRule(None, 4),
    )
    s = MultimodalStore(1 << 20, 4, 1024, 256, {"image": schema})
    tensors = {
        "mask": Tensor("uint8", [16], bytes(16)),  # 16 bytes received, 128 held
        "pixel_values": Tensor("float32", [8], bytes(32)),  # 32 received, 16 as bf16
    }
    wide = MultimodalItem("image", "w", 1, 4, tensors=tensors)
    assert s.engine_bytes([wide]) == 128 + 32
    assert s.engine_bytes([item()]) == 16  # no schema for its tensors: as received
    narrow = MultimodalStore(1 << 20, 4, 1024, 128 + 31, {"image": schema})
    assert "160 bytes as the engine takes them" in problem(narrow, [wide]).message
    assert (
        len(MultimodalStore(1 << 20, 4, 1024, 160, {"image": schema}).resolve(1, [wide], 11)) == 1
    )


def test_tensor_bytes_in_flight_are_bounded_per_client_and_in_all():
    """Issue 51 item 14: accepted requests' tensors wait in the engine; over either bound
    a request is Overloaded (retryable) and, once one finishes, its bytes are free again."""
    h = _vlm_table(max_multimodal_bytes_in_flight_per_client=40, max_multimodal_bytes_in_flight=56)
    for client in (b"c1", b"c2"):
        h.send(client, Hello(1))
        assert h.take(client)[0].limits.max_multimodal_bytes_in_flight_per_client == 40
    h.send(b"c1", Generate("r1", PROMPT, multimodal=[item("a", size=16), item("b", 6, size=16)]))
    assert h.take(b"c1") == [] and len(h.submitted) == 1  # 32 of c1's 40
    h.send(b"c1", Generate("r2", PROMPT, multimodal=[item("c", size=16)]))  # by hash: 16 more
    (over,) = h.take(b"c1")
    assert isinstance(over, Overloaded) and over.request_id == "r2"
    assert (over.limit, over.limit_value, over.current) == (
        "max_multimodal_bytes_in_flight_per_client",
        40,
        32,
    )
    h.send(b"c1", Generate("r3", PROMPT, multimodal=[item("d", size=8)]))  # 40: fits
    h.send(b"c2", Generate("r4", PROMPT, multimodal=[item("e", size=24)]))  # 40 + 24 > 56
    (over,) = h.take(b"c2")
    assert (over.limit, over.current) == ("max_multimodal_bytes_in_flight", 40)
    h.step(FakeOutput(h.submitted[0].request_id, [9], finish_reason=1))  # r1 ends: 32 free
    h.take(b"c1")
    h.send(b"c2", Generate("r4", PROMPT, multimodal=[item("e", size=24)]))
    assert h.take(b"c2") == [] and len(h.submitted) == 3
    h.send(b"c1", Generate("r5", PROMPT, multimodal=[bare("a"), bare("b", 6)]))  # 8 + 32 > 40
    assert h.take(b"c1")[0].limit == "max_multimodal_bytes_in_flight"  # 8 + 24 + 32 > 56


def test_under_cache_isolation_an_items_id_is_each_clients_own():
    """Issue 67 item 7: vLLM keys the encoder cache (and an item's KV blocks) by the item's
    id, so under --cache-isolation the id the engine sees is keyed by the client: equal
    images from two clients get two ids, one client's two requests one; resending by hash
    still works, and without isolation equal tensors share one id."""
    h = _vlm_table()
    for client in (b"c1", b"c2"):
        h.send(client, Hello(1))
        h.take(client)
    h.send(b"c1", Generate("r0", PROMPT, multimodal=[item("h1")]))
    h.send(b"c2", Generate("r0", PROMPT, multimodal=[item("h2")]))
    shared = {request.multimodal[0].hash for request in h.prepared}
    assert len(shared) == 1  # isolation off: the content id, whoever sent it
    h.table.cache_isolation = True
    h.send(b"c1", Generate("r1", PROMPT, multimodal=[item("h1")]))
    h.send(b"c1", Generate("r2", PROMPT, multimodal=[bare("h1", offset=6)]))  # by hash
    h.send(b"c2", Generate("r1", PROMPT, multimodal=[item("h2")]))
    assert all(h.take(client) == [] for client in (b"c1", b"c2"))
    first, again, other = (request.multimodal[0].hash for request in h.prepared[2:])
    assert first == again and first != other
    assert shared.isdisjoint({first, other})
