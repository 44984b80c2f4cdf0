"""TRL 1.16's own ``VLLMClient``, as released, against a base URL, in the venv the setup makes
for it (``.venv-trl``: TRL and its dependencies, over the project's venv for torch and vLLM).

    .venv-trl/bin/python tests/client/http_face/trl_client.py BASE_URL

``ENGINE_GATEWAY_TEST_TOKEN``: the operator's token, which the face's control routes need
(TRL's client sends none; the one line a user adds: ``client.session.headers``). Prints one
JSON line: what ``generate`` returned (n = 2 seeded samples of two token-id prompts, with
logprobs), the world size, the server info TRL reads, and whether ``reset_prefix_cache``
passed; or the error TRL raised.
"""

from __future__ import annotations

import json
import os
import sys


def run(base_url: str) -> dict:
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=base_url, connection_timeout=30)
    client.session.headers["Authorization"] = f"Bearer {os.environ['ENGINE_GATEWAY_TEST_TOKEN']}"
    out = client.generate(
        [[5, 6, 7], [8, 9]],
        n=2,
        temperature=0.9,
        max_tokens=6,
        logprobs=1,
        generation_kwargs={"seed": 5},
    )
    client.reset_prefix_cache()
    info = client.get_server_info()
    return {
        **out,
        "model": client.model,
        "world_size": client.get_world_size(),
        "max_model_len": info["model_config"]["max_model_len"],
        "weight_transfer_config": info["weight_transfer_config"],
        "reset_prefix_cache": True,
    }


def main() -> None:
    try:
        print(json.dumps(run(sys.argv[1])))
    except Exception as exc:  # TRL's own error, for the test to read
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))


if __name__ == "__main__":
    main()
