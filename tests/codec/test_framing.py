"""Each frame-level rule gives its documented ErrorCode, with a precise message."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codec import (
    ErrorCode,
    Generate,
    MultimodalItem,
    PrefixQuery,
    ProtocolError,
    Tensor,
    decode_client,
    encode,
    framing,
    wire_type,
)
from codec.bounds import WireBounds
from codec.messages import CLIENT_TAGS

V1 = b"\x01"


def payload(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def decode_error(frames, **kwargs) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_client(frames, **kwargs)
    return info.value


@pytest.mark.parametrize("frames", [[], [V1], [V1, b"\x90", b"extra"]])
def test_wrong_frame_count_is_bad_frame_count(frames):
    assert decode_error(frames).code is ErrorCode.BAD_FRAME_COUNT


@pytest.mark.parametrize("version", [b"\x00", b"\x02", b"", b"\x01\x01"])
def test_other_version_frames_are_unsupported(version):
    err = decode_error([version, payload([4, 0])])
    assert err.code is ErrorCode.UNSUPPORTED_VERSION


def test_oversize_payload_is_refused_before_decoding():
    big = b"\xc1" * 101  # invalid msgpack: proves the size check runs first
    err = decode_error([V1, big], max_frame_bytes=100)
    assert err.code is ErrorCode.FRAME_TOO_LARGE
    assert "101 bytes" in err.message and "100" in err.message


@pytest.mark.parametrize("raw", [b"", b"\xc1", payload([2, "r", [1, 2, 3]])[:-1], b"\x93\x02"])
def test_truncated_or_invalid_msgpack_is_malformed(raw):
    assert decode_error([V1, raw]).code is ErrorCode.MALFORMED


@pytest.mark.parametrize("tag", [0, 50, 63, 64, 99, -1, "generate", 2.0])
def test_unknown_tags_are_unknown_message(tag):
    err = decode_error([V1, payload([tag, "r", [1]])])
    assert err.code is ErrorCode.UNKNOWN_MESSAGE
    assert repr(tag) in err.message


def test_a_map_instead_of_an_array_is_invalid():
    err = decode_error([V1, payload({"tag": 2})])
    assert err.code is ErrorCode.INVALID_MESSAGE


@pytest.mark.parametrize(
    ("obj", "where"),
    [
        ([2, "r1", [1, -2, 3]], "Generate.prompt_token_ids[1]"),
        ([2, "r1", [1, 2.5]], "Generate.prompt_token_ids[1]"),
        ([2, "r1", [1, "x"]], "Generate.prompt_token_ids[1]"),
        ([2, "r1", [2**31]], "Generate.prompt_token_ids[0]"),
        ([2, "r1", "123"], "Generate.prompt_token_ids"),
        ([2, "r1", [1], "yes"], "Generate.stream"),
        ([2, "r1", [1], True, {"temperature": "hot"}], "Generate.sampling.temperature"),
        ([2, "r1", [1], True, {"temprature": 1.0}], "Generate.sampling"),
        ([2, "r1", [1], True, {}, {"priority": "high"}], "Generate.options.priority"),
        ([2, "r1", [1], True, {"logit_bias": {"7": 1.0}}], "Generate.sampling.logit_bias: "),
        ([2, "", [1]], "Generate.request_id"),
        ([3, [1, 2]], "Abort.request_ids[0]"),
        ([25, "r1", ["0"]], "AbortSamples.samples[0]"),
        ([25, "r1", list(range(1025))], "AbortSamples.samples"),
        ([1, "1"], "Hello.protocol_version"),
    ],
)
def test_wrong_types_and_values_name_the_field(obj, where):
    err = decode_error([V1, payload(obj)])
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message.startswith(where), err.message


def test_a_refused_abort_samples_keeps_its_call_id():
    err = decode_error([V1, payload([25, "r1", list(range(2000)), 9])])
    assert err.code is ErrorCode.INVALID_MESSAGE and err.call_id == 9
    assert "length <= 1024" in err.message


def test_a_wrong_map_key_is_named_as_a_key():
    err = decode_error([V1, payload([2, "r1", [1], True, {"logit_bias": {"7": 1.0}}])])
    assert err.message == "Generate.sampling.logit_bias: Expected `int`, got `str` (in a map key)"


def test_wrong_types_in_a_generate_carry_its_request_id():
    err = decode_error([V1, payload([2, "my-req", [1, -5]])])
    assert err.request_id == "my-req"


def test_missing_required_fields_are_named():
    err = decode_error([V1, payload([2, "r1"])])
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message == "Generate: missing required field(s) prompt_token_ids"
    err = decode_error([V1, payload([1])])
    assert err.message == "Hello: missing required field(s) protocol_version"


def test_extra_trailing_fields_are_refused_on_inbound_messages():
    err = decode_error([V1, payload([4, 1, "extra"])])
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message.startswith("Ping:")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_decode_to_a_message_that_round_trips_or_to_the_right_code(raw):
    try:
        msg = decode_client([V1, raw])
    except ProtocolError as exc:
        untyped = _untyped(raw)
        if untyped is _NOT_MSGPACK:
            assert exc.code is ErrorCode.MALFORMED, exc
        elif not isinstance(untyped, list) or not untyped:
            assert exc.code is ErrorCode.INVALID_MESSAGE, exc
        elif not isinstance(untyped[0], int) or untyped[0] not in CLIENT_TAGS:
            assert exc.code is ErrorCode.UNKNOWN_MESSAGE, exc
        else:
            name = CLIENT_TAGS[untyped[0]].__name__
            assert exc.code in (ErrorCode.INVALID_MESSAGE, ErrorCode.MALFORMED), exc
            assert exc.message.startswith(name) or exc.code is ErrorCode.MALFORMED, exc
    else:
        assert decode_client(encode(msg)) == msg


_NOT_MSGPACK = object()


def _untyped(raw: bytes):
    try:
        return msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return _NOT_MSGPACK


def test_encode_returns_version_and_payload_frames():
    frames = encode(Generate("r", [1]))
    assert frames[0] == V1 and isinstance(frames[1], bytes) and len(frames) == 2


def test_an_invalid_utf8_string_inside_a_message_is_malformed():
    # Generate whose request id is the invalid UTF-8 byte 0xff.
    err = decode_error([V1, b"\x93\x02\xa1\xff\x90"])
    assert err.code is ErrorCode.MALFORMED and "UTF-8" in err.message


def test_a_bare_string_is_not_a_message():
    err = decode_error([V1, b"\xa1a"])  # the str "a" at the root
    assert err.code is ErrorCode.INVALID_MESSAGE and "Expected `array`" in err.message
    err = decode_error([V1, b"\xa1\x80"])  # a root str that is not UTF-8: not msgpack
    assert err.code is ErrorCode.MALFORMED


def _with_mask(mask_len: int, items: int = 1) -> list[bytes]:
    item = MultimodalItem("image", "h", 0, mask_len, is_embed=[True] * mask_len)
    return encode(Generate("r-mm", [1, 2, 3], multimodal=[item] * items))


def test_lists_past_the_gateways_limits_are_refused_from_their_header(monkeypatch):
    """A placeholder mask or PrefixQuery prompt over max_prompt_tokens, or more items than
    max_multimodal_items, is INVALID_REQUEST naming the request and the limit; the
    error path reads headers only for a large frame (never decodes every element)."""
    bounds = WireBounds(max_prompt_tokens=64, max_multimodal_items=2)
    limits = {"max_frame_bytes": 1 << 30, "bounds": bounds}
    exc = decode_error(_with_mask(65), **limits)
    assert exc.code is ErrorCode.INVALID_REQUEST and exc.request_id == "r-mm"
    assert "multimodal[0].is_embed holds more than 64 entries; max_prompt_tokens" in str(exc)
    exc = decode_error(_with_mask(4, items=3), **limits)
    assert exc.code is ErrorCode.INVALID_REQUEST and exc.request_id == "r-mm"
    assert "max_multimodal_items is 2" in str(exc)
    exc = decode_error(encode(PrefixQuery(9, list(range(65)))), **limits)
    assert exc.code is ErrorCode.INVALID_REQUEST and exc.call_id == 9
    assert "max_prompt_tokens is 64" in str(exc)
    # At the limits, all decode (and a decoded message is still the wire's type).
    msg = decode_client(_with_mask(64, items=2), **limits)
    assert isinstance(msg, Generate) and wire_type(msg) is Generate
    assert len(msg.multimodal[1].is_embed) == 64
    assert wire_type(decode_client(encode(PrefixQuery(9, [1] * 64)), **limits)) is PrefixQuery

    class FullDecode:
        def decode(self, payload):
            raise AssertionError(f"a {len(payload)}-byte payload was decoded whole")

    monkeypatch.setattr(framing, "_any_decoder", FullDecode())
    big = _with_mask(2 << 20)
    exc = decode_error(big, **limits)
    assert exc.code is ErrorCode.INVALID_REQUEST and exc.request_id == "r-mm"


def test_a_tensor_has_at_most_16_dims_and_an_item_64_tensors():
    def generate(shape, names):
        tensors = {n: Tensor("uint8", shape, memoryview(b"")) for n in names}
        return encode(
            Generate("r", [1], multimodal=[MultimodalItem("image", "h", 0, 1, None, tensors)])
        )

    assert decode_client(generate([0] * 16, ["a"] * 1)).multimodal[0].tensors["a"].shape == [0] * 16
    for shape, names in (([0] * 17, ["a"]), ([0], [f"t{i}" for i in range(65)])):
        exc = decode_error(generate(shape, names))
        assert exc.code is ErrorCode.INVALID_MESSAGE and exc.request_id == "r"
        assert "Generate.multimodal[0].tensors" in str(exc)
