"""The costliest frames that pass every bound at the default limits: decode time and memory.

    python -m bench.probes.worst_frame [--max-model-len 32768] [--vocab 152064]

Answers: with every client list and map bounded from its header (codec.bounds), what is
the most a single frame can still cost the gateway's loop? Each frame below fills every
bounded list to its bound with its costliest elements (ids past 2^16: 3-byte msgpack
ints that are not Python's cached small ints) and the rest of the frame with what the
decoder reads over without allocating (``kv_transfer_params``, decoded only for allowed
clients) or takes as a view (tensor bytes). Figures: the median of 5 decodes, and
tracemalloc's peak (what Python allocated while decoding, the frame itself excluded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import tracemalloc

import msgspec

from codec import MultimodalItem, ProtocolError, Tensor, decode_client
from codec.bounds import WireBounds
from codec.messages import MAX_ITEM_TENSORS, MAX_TENSOR_DIMS
from gateway.engine import EngineInfo
from gateway.limits import wire_limits
from gateway.sessions import GatewayLimits, frame_limit_for


def _frame(fields: list, size: int) -> bytes:
    """``fields`` (a Generate's first five) encoded with options whose kv_transfer_params
    are empty lists (a byte each: the most objects a byte can make) filling ``size``."""
    room = size - len(msgspec.msgpack.encode(fields)) - 64
    options = {"kv_transfer_params": {"pad": [[]] * max(0, room)}}
    return msgspec.msgpack.encode([*fields, options])


def worst_frames(max_model_len: int, vocab: int) -> dict[str, tuple[bytes, WireBounds, int]]:
    """name -> (payload, bounds, frame limit) at GatewayLimits' defaults."""
    defaults = GatewayLimits()
    text = defaults.for_model(max_model_len)
    images = defaults.for_model(max_model_len, multimodal=True)
    # The bounds a multimodal model's gateway decodes with (as gateway.server builds them).
    info = EngineInfo("probe", max_model_len, vocab, (0,), max_logprobs=20, max_num_seqs=256)
    bounds = WireBounds.of(wire_limits(images, info, multimodal=True), vocab)
    big = 70_000  # an id past 2^16: three msgpack bytes, a Python int object each
    sampling = {
        "stop_token_ids": [big] * vocab,
        "allowed_token_ids": [big] * vocab,
        "logit_bias": {big + i: 0.5 for i in range(vocab)},
        "bad_words_token_ids": [[big] * defaults.max_bad_word_len] * defaults.max_bad_words,
        "stop_token_sequences": [[big] * defaults.max_stop_sequence_len]
        * defaults.max_stop_sequences,
    }
    prompt = [big] * max_model_len
    tensors = {
        f"t{i}": Tensor("uint8", [1] * MAX_TENSOR_DIMS, memoryview(b"\0"))
        for i in range(MAX_ITEM_TENSORS)
    }
    item = MultimodalItem("image", "h" * 256, 0, max_model_len, [True] * max_model_len, tensors)
    items = [item] * defaults.max_multimodal_items
    text_limit = text.max_frame_bytes or frame_limit_for(max_model_len)
    image_limit = images.max_frame_bytes or 0
    lists_only = [2, "r" * 256, prompt, True, sampling, None, items]
    return {
        "every list at its bound (no frame limit)": (
            msgspec.msgpack.encode(lists_only),
            bounds,
            1 << 34,
        ),
        "text model: a prompt at max_model_len, padding to the frame limit": (
            _frame([2, "r", prompt, True, {}], text_limit),
            bounds,
            text_limit,
        ),
        "multimodal model: the frame limit of nested kv_transfer_params": (
            _frame([2, "r", [1], True, {}], image_limit),
            bounds,
            image_limit,
        ),
        "abort: max_abort_ids ids of 256 characters": (
            msgspec.msgpack.encode([3, ["x" * 256] * defaults.max_abort_ids, 1]),
            bounds,
            1 << 34,
        ),
    }


def measure(payload: bytes, bounds: WireBounds, limit: int) -> dict:
    frames = [b"\x01", payload]
    times = []
    outcome = "decoded"
    for _ in range(5):
        start = time.perf_counter()
        try:
            decode_client(frames, limit, bounds)
        except ProtocolError as exc:
            outcome = f"refused: {exc.code.name}"
        times.append(time.perf_counter() - start)
    tracemalloc.start()
    with contextlib.suppress(ProtocolError):
        decode_client(frames, limit, bounds)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "frame_bytes": len(payload),
        "outcome": outcome,
        "decode_ms": round(statistics.median(times) * 1e3, 2),
        "peak_alloc_mb": round(peak / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=152064)
    args = parser.parse_args()
    results = {
        name: measure(*frame)
        for name, frame in worst_frames(args.max_model_len, args.vocab).items()
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
