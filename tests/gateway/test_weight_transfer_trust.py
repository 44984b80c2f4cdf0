"""What a client sends with the ``nccl`` weight-transfer backend is data only, never code
for the engine to run: vLLM's TCPStore rendezvous (``master_address``/``master_port``) makes
the workers join the store at the client's address and unpickle what it holds, and an
UpdateWeights field vLLM would unpickle (``*_pickled``) is refused before vLLM parses it. A
real engine with the ``nccl`` backend (it starts on a CPU; only a transfer needs CUDA) in a
gateway process."""

from __future__ import annotations

import json
import socket

import pytest

from client import RequestFailed
from codec import ErrorCode
from tests.helpers import RecordingClient, greedy

pytestmark = pytest.mark.engine


async def test_a_store_rendezvous_and_a_pickled_chunk_are_refused_and_the_model_serves_on(
    gateway_process,
):
    from gateway.tiny_model import ensure_tiny_model

    hidden = json.loads((ensure_tiny_model() / "config.json").read_text())["hidden_size"]
    gw = gateway_process("--control-open", "--weight-transfer-config", '{"backend": "nccl"}')
    with socket.create_server(("127.0.0.1", 0)) as store:  # where a trainer's store would be
        store.setblocking(False)
        async with RecordingClient(gw.address, connect_timeout_s=240) as client:
            before = (await client.complete([5, 6, 7], greedy(16))).token_ids
            rendezvous = {"master_port": store.getsockname()[1], "rank_offset": 1, "world_size": 2}
            with pytest.raises(RequestFailed) as refused:
                await client.init_weight_transfer_engine(
                    {"master_address": "127.0.0.1", **rendezvous}
                )
            assert refused.value.code == ErrorCode.INVALID_REQUEST
            assert "init_info.master_address/master_port" in str(refused.value)
            assert "nccl_unique_id_b64" in str(refused.value)  # what to send instead
            with pytest.raises(BlockingIOError):
                store.accept()  # no worker came to the store

            chunk = {  # a tensor of the checkpoint, of its shape: only the pickle is wrong
                "names": ["model.norm.weight"],
                "dtype_names": ["bfloat16"],
                "shapes": [[hidden]],
                "ipc_handles_pickled": "gASVAAAAAAAAAAAu",
            }
            for update_info in (chunk, [chunk]):  # a map, and the data-parallel list form
                await client.start_weight_update()
                with pytest.raises(RequestFailed) as refused:
                    await client.update_weights(update_info)
                assert refused.value.code == ErrorCode.INVALID_REQUEST
                assert "update_info.ipc_handles_pickled is a pickle" in str(refused.value)
                with pytest.raises(RequestFailed, match="no weight update is open"):
                    await client.abandon_weight_update()  # the refusal ended the update
            assert (await client.complete([5, 6, 7], greedy(16))).token_ids == before
