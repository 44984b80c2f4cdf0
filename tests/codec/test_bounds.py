"""Every list and map of a client message is bounded from its msgpack header: a frame with
one over its bound is refused by name, without its elements ever being decoded."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest

from codec import (
    Abort,
    ErrorCode,
    Generate,
    InitWeightTransfer,
    MultimodalItem,
    PrefixQuery,
    ProtocolError,
    RequestOptions,
    SamplingParams,
    UpdateWeights,
    WakeUp,
    decode_client,
    encode,
)
from codec.bounds import WireBounds, decode_kv_params
from codec.messages import MAX_OPAQUE_DEPTH, MAX_OPAQUE_LEN, MAX_WAKE_UP_TAGS

V1 = b"\x01"
BOUNDS = WireBounds(
    max_prompt_tokens=4096,
    vocab_size=1000,
    max_multimodal_items=4,
    max_abort_ids=100,
    max_stop_sequences=8,
    max_stop_sequence_len=16,
    max_bad_words=32,
    max_bad_word_len=16,
)
BIG = 8 << 20  # bytes of list in each oversized frame
HUGE_FRAME = 1 << 30


def refused(payload: bytes) -> tuple[ProtocolError, int]:
    """The refusal of ``payload`` under BOUNDS and the peak bytes Python allocated for it."""
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            decode_client([V1, payload], HUGE_FRAME, BOUNDS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return info.value, peak


def generate(**sampling) -> bytes:
    return msgspec.msgpack.encode([2, "r-big", [1, 2, 3], True, sampling])


def encoded(*fields) -> bytes:
    return msgspec.msgpack.encode(list(fields))


REQ, MSG = "INVALID_REQUEST", "INVALID_MESSAGE"
OVER_BOUNDS = {  # field: (payload, code, the limit named)
    "sampling.stop_token_ids": (generate(stop_token_ids=[7] * BIG), REQ, "vocab_size is 1000"),
    "sampling.allowed_token_ids": (
        generate(allowed_token_ids=[7] * BIG),
        REQ,
        "vocab_size is 1000",
    ),
    "sampling.logit_bias": (
        generate(logit_bias={i: 0.0 for i in range(BIG // 8)}),
        REQ,
        "vocab_size is 1000",
    ),
    "sampling.bad_words_token_ids": (
        generate(bad_words_token_ids=[[1]] * (BIG // 2)),
        REQ,
        "max_bad_words is 32",
    ),
    "sampling.bad_words_token_ids[0]": (
        generate(bad_words_token_ids=[[1] * BIG]),
        REQ,
        "max_bad_word_len is 16",
    ),
    "sampling.stop_token_sequences": (
        generate(stop_token_sequences=[[1]] * (BIG // 2)),
        REQ,
        "max_stop_sequences is 8",
    ),
    "sampling.stop_token_sequences[1]": (
        generate(stop_token_sequences=[[1], [1] * BIG]),
        REQ,
        "max_stop_sequence_len is 16",
    ),
    "multimodal": (encoded(2, "r-big", [1], True, {}, None, [{}] * BIG), REQ, "items is 4"),
    "prompt_token_ids": (encoded(23, 5, [1] * BIG), REQ, "max_prompt_tokens is 4096"),
    "request_ids": (encoded(3, [""] * BIG, 5), MSG, "max_abort_ids is 100"),
}


@pytest.mark.parametrize("field", list(OVER_BOUNDS))
def test_a_list_over_its_bound_is_refused_from_its_header(field):
    """Refused naming the message, the field and the limit, with the request or call id;
    Python allocates well under the frame's size (a full decode of these takes 8-40x it)."""
    payload, code, limit = OVER_BOUNDS[field]
    exc, peak = refused(payload)
    assert exc.code is ErrorCode[code], exc
    assert field in exc.message and limit in exc.message, exc.message
    assert exc.request_id == "r-big" or exc.call_id == 5 or exc.message.startswith("Abort"), exc
    assert peak < len(payload) // 16, (peak, len(payload))


def test_an_aborts_ids_over_the_bound_keep_the_call_id_when_few_enough_to_walk():
    exc, _ = refused(msgspec.msgpack.encode([3, ["x"] * 101, 42]))
    assert (exc.code, exc.call_id) == (ErrorCode.INVALID_MESSAGE, 42)
    assert exc.message == "Abort.request_ids holds more than 100 entries; max_abort_ids is 100"


def test_lists_at_their_bounds_decode():
    sampling = SamplingParams(
        stop_token_ids=[1] * 1000,
        allowed_token_ids=list(range(1000)),
        logit_bias={i: 1.0 for i in range(1000)},
        bad_words_token_ids=[[1] * 16] * 32,
        stop_token_sequences=[[2] * 16] * 8,
    )
    msg = decode_client(encode(Generate("r", [1], sampling=sampling)), HUGE_FRAME, BOUNDS)
    assert msgspec.structs.asdict(msg.sampling) == msgspec.structs.asdict(sampling)
    abort = decode_client(encode(Abort(["a"] * 100, 3)), HUGE_FRAME, BOUNDS)
    assert len(abort.request_ids) == 100


def test_wake_up_tags_and_backend_maps_are_bounded_for_every_decoder():
    """Fixed bounds (the wire structs'): no gateway limit needed, none can be lifted."""
    for bounds in (None, BOUNDS):
        with pytest.raises(ProtocolError) as info:
            decode_client(encode(WakeUp(1, ["weights"] * (MAX_WAKE_UP_TAGS + 1))), BIG, bounds)
        assert info.value.code is ErrorCode.INVALID_MESSAGE and info.value.call_id == 1
        assert "WakeUp.tags" in info.value.message
    too_long = {"names": [""] * (MAX_OPAQUE_LEN + 1)}
    too_deep = {"a": [[[[1]]]]}  # a list three deep below the map holds only scalars
    for info_map in (too_long, too_deep):
        for msg in (InitWeightTransfer(2, info_map), UpdateWeights(2, info_map)):
            with pytest.raises(ProtocolError) as info:
                decode_client(encode(msg), HUGE_FRAME, BOUNDS)
            assert info.value.code is ErrorCode.INVALID_MESSAGE and info.value.call_id == 2
    fine = {"names": ["w"], "shapes": [[4, 4]], "dtype_names": ["float32"], "packed": True}
    assert decode_client(encode(UpdateWeights(3, [fine, fine])), BIG, BOUNDS).update_info[1] == fine
    assert MAX_OPAQUE_DEPTH == 3


def test_nesting_deeper_than_the_decoder_walks_is_invalid_not_a_crash():
    """A value nested past the interpreter's recursion limit (msgspec's decoder, typed or
    not, recurses) is INVALID_MESSAGE naming the request, not a RecursionError."""
    deep = b"\x91" * 100_000 + b"\xc0"
    for payload in (
        b"\x95\x02\xa1r\x91\x01\xc3\x81\xa1n" + deep,  # a sampling value
        b"\x96\x02\xa1r\x91\x01\xc3\x80\x81\xb2kv_transfer_params" + deep,  # a skipped one
    ):
        for bounds in (None, BOUNDS):
            with pytest.raises(ProtocolError) as info:
                decode_client([V1, payload], HUGE_FRAME, bounds)
            assert info.value.code is ErrorCode.INVALID_MESSAGE, info.value
            assert info.value.request_id == "r"


def test_kv_transfer_params_are_left_undecoded_by_a_gateway_then_decoded_bounded():
    """A gateway's decoder reads over them (they are only for allowed clients: the session
    table decodes them once the sender is known to be one), so a stranger's cost nothing."""
    params = {"remote_block_ids": [[0]] * (BIG // 2)}
    payload = encode(Generate("r", [1], options=RequestOptions(kv_transfer_params=params)))
    tracemalloc.start()
    try:
        msg = decode_client(payload, HUGE_FRAME, BOUNDS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(msg.options.kv_transfer_params, msgspec.Raw)
    assert peak < len(payload[1]) // 16, peak
    with pytest.raises(ValueError, match="kv_transfer_params"):
        decode_kv_params(msg.options.kv_transfer_params)  # four deep: over the bound
    fine = {"remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 5, "tp": None}
    payload = encode(Generate("r", [1], options=RequestOptions(kv_transfer_params=fine)))
    assert decode_kv_params(decode_client(payload, BIG, BOUNDS).options.kv_transfer_params) == fine
    assert decode_kv_params(fine) is fine  # a message made in process passes as it is


def test_bounded_types_keep_the_wire_types_rules():
    """Mutants the suite let live: the bounded PrefixQuery prompt without the token-id
    range (negative ids decoded), and a bounded item's ``is_embed`` made required."""
    with pytest.raises(ProtocolError) as info:
        decode_client(encode(PrefixQuery(3, [5, -1])), BIG, BOUNDS)
    assert info.value.code is ErrorCode.INVALID_MESSAGE and info.value.call_id == 3
    assert "PrefixQuery.prompt_token_ids[1]" in info.value.message
    item = MultimodalItem("image", "h", 0, 2)  # no mask: every position takes embeddings
    msg = decode_client(encode(Generate("r", [1, 2], multimodal=[item])), BIG, BOUNDS)
    assert msg.multimodal[0].is_embed is None


def test_a_gateways_bounds_come_from_the_limits_it_announces():
    from codec import Limits
    from codec.bounds import kv_params_given

    limits = Limits(
        max_prompt_tokens=100, max_in_flight_per_client=1, max_in_flight_total=1,
        max_frame_bytes=1, max_abort_ids=7, max_logprobs=1, max_stop_sequences=3,
        max_stop_sequence_len=4, max_bad_words=5, max_bad_word_len=6,
    )  # fmt: skip
    bounds = WireBounds.of(limits, 321)
    assert bounds == WireBounds(100, 321, None, 7, 3, 4, 5, 6)  # no items: not by count
    with_items = WireBounds.of(msgspec.structs.replace(limits, max_multimodal_items=2), 321)
    assert with_items.max_multimodal_items == 2
    raw_nil = msgspec.msgpack.decode(b"\xc0", type=msgspec.Raw)
    raw_map = msgspec.msgpack.decode(msgspec.msgpack.encode({"a": 1}), type=msgspec.Raw)
    given = [
        kv_params_given(options)
        for options in (
            None,
            RequestOptions(),
            RequestOptions(kv_transfer_params=raw_nil),
            RequestOptions(kv_transfer_params=raw_map),
            RequestOptions(kv_transfer_params={"a": 1}),
        )
    ]
    assert given == [False, False, False, True, True]
    assert decode_kv_params(raw_map) == {"a": 1}
