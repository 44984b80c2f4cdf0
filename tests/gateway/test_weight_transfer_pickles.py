"""A client's UpdateWeights chunk never runs code in the engine. vLLM's ``ipc`` backend
unpickles ``ipc_handles_pickled`` wherever the operator set
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM's HTTP routes need it for that backend); through
the gateway such a chunk is refused before vLLM parses it. A real engine with the ``ipc``
backend (it starts on a CPU; only its transfers need CUDA) in a gateway process with that
variable set, and a pickle that would make a folder if it were ever loaded."""

from __future__ import annotations

import base64
import json
import os
import pickle

import pytest

from client import RequestFailed
from codec import ErrorCode
from tests.helpers import RecordingClient, greedy

pytestmark = pytest.mark.engine


class _MakesFolder:
    """Unpickled, calls ``os.mkdir(path)``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


async def test_a_pickled_chunk_is_refused_unread_and_the_old_weights_serve_on(
    gateway_process, tmp_path
):
    from gateway.tiny_model import ensure_tiny_model

    hidden = json.loads((ensure_tiny_model() / "config.json").read_text())["hidden_size"]
    marker = tmp_path / "unpickled"
    chunk = {  # a tensor the served checkpoint has, of its shape: only the pickle is wrong
        "names": ["model.norm.weight"],
        "dtype_names": ["bfloat16"],
        "shapes": [[hidden]],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps([_MakesFolder(str(marker))])).decode(),
    }
    gw = gateway_process(
        "--control-open",
        "--weight-transfer-config",
        '{"backend": "ipc"}',
        env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
    )
    async with RecordingClient(gw.address, connect_timeout_s=240) as client:
        before = (await client.complete([5, 6, 7], greedy(16))).token_ids
        await client.init_weight_transfer_engine({"packed": False})
        for update_info in (chunk, [chunk]):  # a map, and the data-parallel list form
            await client.start_weight_update()
            with pytest.raises(RequestFailed) as refused:
                await client.update_weights(update_info)
            assert not marker.exists(), "the engine unpickled a client's bytes"
            assert refused.value.code == ErrorCode.INVALID_REQUEST
            assert "update_info.ipc_handles_pickled is a pickle" in str(refused.value)
            with pytest.raises(RequestFailed, match="no weight update is open"):
                await client.abandon_weight_update()  # the refusal ended the update
        assert (await client.complete([5, 6, 7], greedy(16))).token_ids == before
