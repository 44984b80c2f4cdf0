"""Codec micro-benchmarks: the figures quoted in docs/PROTOCOL.md ("Performance").

    python -m bench.probes.codec_bench

Measures encode+decode of (a) a 256-request, one-token-each Outputs batch and
(b) a 4,096-token Generate, and compares token arrays as msgpack int lists
against a bin of little-endian int32 (the alternative the protocol rejected).
"""

from __future__ import annotations

import array
import json
import platform
import random
import sys
import timeit

import msgspec

from codec import (
    Generate,
    Outputs,
    RequestOutput,
    SamplingParams,
    decode_client,
    decode_server,
    encode,
)


class _BinGenerate(msgspec.Struct, array_like=True, tag=2):
    request_id: str
    prompt_token_ids: bytes  # little-endian int32
    stream: bool = True


class _BinOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: bytes
    finished: None = None


class _BinOutputs(msgspec.Struct, array_like=True, tag=65):
    outputs: list[_BinOutput]


def _time(fn, number: int) -> float:
    """Best of 5 repeats, microseconds per call."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def run() -> dict:
    rng = random.Random(0)
    vocab = 128_256  # a Llama-3-sized vocabulary: most ids need 3 or 5 msgpack bytes
    prompt = [rng.randrange(vocab) for _ in range(4096)]
    batch = Outputs([RequestOutput(f"req-{i}", [rng.randrange(vocab)]) for i in range(256)])
    gen = Generate("req-1", prompt, True, SamplingParams(temperature=0.0, max_tokens=128))

    gen_frames = encode(gen)
    out_frames = encode(batch)
    enc = msgspec.msgpack.Encoder()
    bin_gen_dec = msgspec.msgpack.Decoder(_BinGenerate)
    bin_out_dec = msgspec.msgpack.Decoder(_BinOutputs)

    def bin_gen_roundtrip() -> list[int]:
        raw = enc.encode(_BinGenerate("req-1", array.array("i", prompt).tobytes()))
        msg = bin_gen_dec.decode(raw)
        ids = array.array("i")
        ids.frombytes(msg.prompt_token_ids)
        return ids.tolist()  # vLLM wants list[int]

    def bin_out_roundtrip() -> list[list[int]]:
        raw = enc.encode(
            _BinOutputs(
                [
                    _BinOutput(o.request_id, array.array("i", o.new_token_ids).tobytes())
                    for o in batch.outputs
                ]
            )
        )
        return [array.array("i", o.new_token_ids).tolist() for o in bin_out_dec.decode(raw).outputs]

    results = {
        "python": sys.version.split()[0],
        "msgspec": msgspec.__version__,
        "machine": platform.machine(),
        "generate_4096": {
            "bytes_msgpack_list": len(gen_frames[1]),
            "bytes_int32_bin": len(
                enc.encode(_BinGenerate("req-1", array.array("i", prompt).tobytes()))
            ),
            "encode_us": _time(lambda: encode(gen), 2000),
            "decode_us": _time(lambda: decode_client(gen_frames), 2000),
            "roundtrip_us_msgpack_list": _time(lambda: decode_client(encode(gen)), 2000),
            "roundtrip_us_int32_bin": _time(bin_gen_roundtrip, 2000),
        },
        "outputs_256x1": {
            "bytes_msgpack_list": len(out_frames[1]),
            "encode_us": _time(lambda: encode(batch), 2000),
            "decode_us": _time(lambda: decode_server(out_frames), 2000),
            "roundtrip_us_msgpack_list": _time(lambda: decode_server(encode(batch)), 2000),
            "roundtrip_us_int32_bin": _time(bin_out_roundtrip, 2000),
        },
    }
    return results


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
