"""The hex dumps in docs/PROTOCOL.md are real frames that decode to the values shown."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from codec import (
    Abort,
    AbortAck,
    AbortSamples,
    ControlDone,
    Error,
    ErrorCode,
    FinishWeightUpdate,
    Generate,
    Goodbye,
    Hello,
    Outputs,
    Pause,
    PrefixQuery,
    PrefixReply,
    StartWeightUpdate,
    UpdateWeights,
    decode_client,
    decode_server,
    encode,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
_PAIR = re.compile(r"```hex\n(.*?)```\n```json\n(.*?)```", re.S)


def _bins(value: object) -> object:
    """The JSON's ``{"$bin": hex}`` stands for msgpack bin."""
    if isinstance(value, dict):
        if set(value) == {"$bin"}:
            return bytes.fromhex(value["$bin"])
        return {k: _bins(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bins(v) for v in value]
    return value


def _dumps() -> list[tuple[list[bytes], object]]:
    pairs = []
    for hex_text, json_text in _PAIR.findall(DOC.read_text()):
        lines = hex_text.strip().splitlines()
        version = bytes.fromhex(lines[0])
        payload = bytes.fromhex(" ".join(lines[1:]))
        pairs.append(([version, payload], _bins(json.loads(json_text))))
    return pairs


def test_the_document_has_its_dumps():
    tags = [value[0] for _, value in _dumps()]
    assert tags == [1, 2, 2, 65, 3, 66, 25, 67, 7, 72, 19, 20, 21, 23, 74, 26]


@pytest.mark.parametrize(("frames", "value"), _dumps())
def test_each_dump_decodes_to_its_documented_value(frames, value):
    assert msgspec.msgpack.decode(frames[1]) == value
    tag = value[0]
    msg = decode_server(frames) if tag >= 64 else decode_client(frames)
    assert encode(msg) == frames  # and our encoder produces exactly these bytes


def test_dumps_decode_to_the_described_messages():
    dumps = [frames for frames, _ in _dumps()]
    hello, generate, images, outputs, abort, error, abort_samples, ack = dumps[:8]
    pause, done, start, update, finish, query = dumps[8:-2]
    reply, goodbye = dumps[-2:]
    h = decode_client(hello)
    assert isinstance(h, Hello) and h.client_name == "demo" and h.heartbeat_interval_s == 2.0
    g = decode_client(generate)
    assert isinstance(g, Generate)
    assert (g.request_id, g.prompt_token_ids, g.stream) == ("req-7", [1, 300, 70000], True)
    assert (g.sampling.temperature, g.sampling.max_tokens, g.sampling.stop_token_ids) == (
        0.0,
        16,
        [2],
    )
    assert g.multimodal is None
    m = decode_client(images)
    assert isinstance(m, Generate) and m.prompt_token_ids == [50, 4, 6, 6, 60, 6, 6]
    first_item, again = m.multimodal
    assert (first_item.hash, first_item.offset, first_item.length) == ("img-1", 1, 3)
    assert first_item.is_embed == [False, True, True]
    pixels = first_item.tensors["pixel_values"]
    assert (pixels.dtype, pixels.shape) == ("bfloat16", [1, 2])
    assert bytes(pixels.data) == b"\x00?\x80\xbf"
    assert bytes(first_item.tensors["num_patches"].data) == (1).to_bytes(8, "little")
    assert (again.hash, again.offset, again.length, again.tensors) == ("img-1", 5, 2, None)
    o = decode_server(outputs)
    assert isinstance(o, Outputs)
    first, second = o.outputs
    assert first.new_token_ids == [42] and first.finished is None
    assert second.new_token_ids == [7, 8]
    assert (second.finished.finish_reason, second.finished.stop_reason) == (0, 2)
    assert (second.finished.prompt_tokens, second.finished.output_tokens) == (3, 12)
    a = decode_client(abort)
    assert isinstance(a, Abort) and (a.request_ids, a.call_id) == (["r1", "r2", "r3"], 9)
    e = decode_server(error)
    assert isinstance(e, Error) and e.request_id is None and e.call_id == 9
    assert e.code is ErrorCode.INVALID_MESSAGE
    s = decode_client(abort_samples)
    assert isinstance(s, AbortSamples) and (s.request_id, s.samples, s.call_id) == ("r1", [1], 7)
    k = decode_server(ack)
    assert isinstance(k, AbortAck) and (k.aborted, k.unknown, k.call_id) == (["r1"], [], 7)
    p = decode_client(pause)
    assert isinstance(p, Pause) and (p.call_id, p.mode, p.clear_cache) == (5, "keep", False)
    d = decode_server(done)
    assert isinstance(d, ControlDone) and (d.call_id, d.operation, d.result) == (5, "pause", "keep")
    assert first.weight_version == "v1" and second.weight_version is None
    (span,) = second.finished.weight_versions
    assert (span.version, span.first_token, span.num_tokens) == ("v1", 0, 12)
    assert second.finished.timings.finished_s == 12.5
    st = decode_client(start)
    assert isinstance(st, StartWeightUpdate) and (st.call_id, st.pause) == (7, "wait")
    u = decode_client(update)
    assert isinstance(u, UpdateWeights) and u.call_id == 8
    assert u.update_info == {
        "buffer": "/dev/shm/engine-gateway-weights-4242-k3/bucket-0",
        "names": ["lm_head.weight"],
        "dtype_names": ["bfloat16"],
        "shapes": [[512, 128]],
        "offsets": [0],
    }
    f = decode_client(finish)
    assert isinstance(f, FinishWeightUpdate) and (f.call_id, f.version) == (9, "v2")
    q = decode_client(query)
    assert isinstance(q, PrefixQuery) and (q.call_id, q.prompt_token_ids) == (5, [1, 300, 70000])
    assert isinstance(decode_client(goodbye), Goodbye)
    r = decode_server(reply)
    assert isinstance(r, PrefixReply)
    assert (r.call_id, r.block_size, r.matched_tokens, r.routing) == (5, 32, [64, None], "cache")
