"""A real KV connector for the prefill/decode tests: vLLM's ExampleConnector (KV blocks as
files under a shared folder), which also returns kv_transfer_params when a request
finishes, as production connectors (NIXL) do, and records the params each request
arrived with. Both records go to ``<shared_storage_path>/params/`` for the tests to read.

Loaded by the engine itself: ``kv_connector_module_path="tests.pd_connector"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class RecordingExampleConnector(ExampleConnector):
    def _record(self, kind: str, request: Any, params: Any) -> None:
        folder = Path(self._storage_path) / "params"
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{kind}-{request.request_id}.json"
        (folder / name).write_text(json.dumps(params, sort_keys=True))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):  # noqa: ANN201
        if request.kv_transfer_params is not None:
            self._record("received", request, request.kv_transfer_params)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: Any, block_ids: list[int]):  # noqa: ANN201
        delay, _ = super().request_finished(request, block_ids)
        params = {
            "producer": self._kv_transfer_config.kv_role,
            "prompt_tokens": len(request.prompt_token_ids),
            "storage": str(self._storage_path),
            "received": request.kv_transfer_params,
        }
        self._record("returned", request, params)
        return delay, params
