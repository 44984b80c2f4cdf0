"""Every wire message survives encode -> frames -> decode unchanged."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings

from codec import (
    Finished,
    FinishReason,
    Generate,
    Outputs,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    decode_client,
    decode_server,
    encode,
)
from codec.messages import CLIENT_TAGS, SERVER_TAGS, ClientMessage, ServerMessage
from tests.strategies import client_messages, server_messages


@settings(max_examples=300, deadline=None)
@given(client_messages)
def test_every_client_message_round_trips(msg):
    assert decode_client(encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(server_messages)
def test_every_server_message_round_trips(msg):
    assert decode_server(encode(msg)) == msg


def test_tags_are_unique_and_in_their_ranges():
    assert all(1 <= tag <= 63 for tag in CLIENT_TAGS)
    assert all(64 <= tag <= 127 for tag in SERVER_TAGS)
    assert len(CLIENT_TAGS) == len(ClientMessage.__args__) and len(SERVER_TAGS) == len(
        ServerMessage.__args__
    )
    assert sorted(CLIENT_TAGS) == list(range(1, len(CLIENT_TAGS) + 1))  # dense, in order


def test_omitted_trailing_fields_take_their_defaults():
    payload = msgspec.msgpack.encode([2, "r", [1, 2]])
    msg = decode_client([b"\x01", payload])
    assert msg == Generate("r", [1, 2], True, SamplingParams(), None)


def test_sampling_params_travel_as_a_map_of_only_the_set_fields():
    msg = Generate("r", [1], sampling=SamplingParams(temperature=0.0, max_tokens=4))
    raw = msgspec.msgpack.decode(encode(msg)[1])
    assert raw[4] == {"temperature": 0.0, "max_tokens": 4}


def test_a_client_ignores_fields_a_newer_gateway_appends():
    out = [["r", [7], None, None, None, 0, None, "a field from the future"]]
    payload = msgspec.msgpack.encode([65, out, "another"])
    assert decode_server([b"\x01", payload]) == Outputs([RequestOutput("r", [7])])


def test_one_token_output_is_compact():
    frame = encode(Outputs([RequestOutput("r1", [300])]))[1]
    assert len(frame) == 16  # 3 array headers, tag, "r1", token list, 4 nils, index
    final = encode(Outputs([RequestOutput("r1", [5], Finished(FinishReason.STOP, 2, 10, 5))]))[1]
    assert len(final) <= 25  # Finished: 9 fields, the last four nil / 0 / nil / nil
    timed = Finished(FinishReason.STOP, 2, 10, 5, timings=RequestTimings(0.001, 0.002, 0.01, 0.5))
    assert len(encode(Outputs([RequestOutput("r1", [5], timed)]))[1]) <= 60
