"""A three-turn rollout with tool messages through verifiers' own ``TrainClient`` (verifiers
0.4.0, renderers 0.1.12, as released), run in the venv the setup makes for them
(``.venv-verifiers``): the client is used unchanged, pointed at a base URL.

    .venv-verifiers/bin/python tests/client/http_face/verifiers_rollout.py BASE_URL \\
        TOKENIZER_DIR MODEL

Prints one JSON line: per turn the prompt ids, completion ids and logprobs, finish reason
and content verifiers parsed, and the renderer's stop ids; or the error verifiers raised
(its type and message).
"""

from __future__ import annotations

import asyncio
import json
import sys


async def rollout(base_url: str, tokenizer: str, model: str) -> dict:
    from renderers import DefaultRendererConfig
    from verifiers.v1.clients.train import ElasticRendererPool, TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    config = TrainClientConfig(
        base_url=f"{base_url}/v1",
        api_key_var="ENGINE_GATEWAY_TEST_TOKEN",
        # The tokenizer's own (ChatML) template: renderers' model-specific renderers need
        # their model's special tokens, and its default one takes no tool definitions.
        renderer=DefaultRendererConfig(),
        renderer_model_name=tokenizer,
    )
    client = TrainClient(config)
    messages: list[dict] = [
        {"role": "system", "content": "You answer with one word."},
        {"role": "user", "content": "What is the capital of the sea?"},
    ]
    sampling = SamplingConfig(temperature=0.0, max_tokens=12)
    turns = []
    try:
        for turn in range(3):
            body = {"model": model, "messages": messages}
            response = await client.get_response(
                ChatDialect(), body, sampling, session_id="episode-7"
            )
            tokens = response.tokens
            turns.append(
                {
                    "prompt_ids": list(tokens.prompt_ids),
                    "completion_ids": list(tokens.completion_ids),
                    "completion_logprobs": list(tokens.completion_logprobs),
                    "finish_reason": response.finish_reason,
                    "content": response.message.content,
                }
            )
            messages.append({"role": "assistant", "content": response.message.content or ""})
            messages.append(
                {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"result {turn}"}
            )
    finally:
        await client.close()
    (slots,) = ElasticRendererPool._renderers.values()
    return {"turns": turns, "stop_token_ids": slots[0].renderer.get_stop_token_ids()}


def main() -> None:
    base_url, tokenizer, model = sys.argv[1:4]
    try:
        print(json.dumps(asyncio.run(rollout(base_url, tokenizer, model))))
    except Exception as exc:  # the framework's own error, for the test to read
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))


if __name__ == "__main__":
    main()
