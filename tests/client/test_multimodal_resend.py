"""The client's one full resend after MULTIMODAL_ITEM_UNKNOWN, against a scripted gateway
(a raw ROUTER): a resend larger than the gateway's max_frame_bytes ends the stream with
FRAME_TOO_LARGE instead of leaving it waiting forever."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from client import AsyncClient, MultimodalItem, RequestFailed, SamplingParams, Tensor
from codec import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Generate,
    HelloAck,
    Limits,
    ModelInfo,
    decode_client,
    encode,
)
from tests.conftest import ipc_address


async def test_a_full_resend_over_the_frame_limit_ends_the_stream():
    address = ipc_address("resend")
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    limits = Limits(512, 8, 64, 4096, 8, 0)  # frames of at most 4 KiB
    model = ModelInfo("scripted", 512, 1000, [2], modalities=["image"])

    async def gateway() -> None:
        while True:
            identity, *frames = await router.recv_multipart()
            msg = decode_client(frames)
            if type(msg).__name__ == "Hello":
                ack = HelloAck(PROTOCOL_VERSION, "scripted", model, limits, 1.0, 10.0, 7)
                await router.send_multipart([identity, *encode(ack)])
            elif isinstance(msg, Generate):  # held by no one: MULTIMODAL_ITEM_UNKNOWN
                error = Error(msg.request_id, ErrorCode.MULTIMODAL_ITEM_UNKNOWN, "unknown")
                await router.send_multipart([identity, *encode(error)])

    server = asyncio.ensure_future(gateway())
    big = Tensor("uint8", [8192], bytes(8192))  # fits no frame
    item = MultimodalItem("image", "img", 0, 1, None, {"pixel_values": big})
    try:
        async with AsyncClient(address) as client:
            client._multimodal_sent.add("img")  # as if sent earlier: it goes by hash
            async with asyncio.timeout(10):
                try:
                    async for _ in client.generate([5], SamplingParams(), multimodal=[item]):
                        pass
                except RequestFailed as exc:
                    assert exc.code is ErrorCode.FRAME_TOO_LARGE
                else:
                    raise AssertionError("the stream ended without an error")
    finally:
        server.cancel()
        router.close(0)
        ctx.term()
