"""A three-turn rollout with tool messages through verifiers' own ``TrainClient`` (verifiers
0.4.0, renderers 0.1.12, as released), run in the venv the setup makes for them
(``.venv-verifiers``): the client is used unchanged, pointed at a base URL.

    .venv-verifiers/bin/python tests/client/http_face/verifiers_rollout.py TARGET \\
        TOKENIZER_DIR MODEL

TARGET: the HTTP face's base URL, or a gateway's address for the native adapter
(``client.frameworks.verifiers``: run with the repository on PYTHONPATH).

Prints one JSON line: per turn the prompt ids, completion ids and logprobs, finish reason
and content verifiers parsed, and the renderer's stop ids; or the error verifiers raised
(its type and message).
"""

from __future__ import annotations

import asyncio
import json
import sys


async def rollout(target: str, tokenizer: str, model: str) -> dict:
    """The rollout through ``target``: an HTTP base URL (verifiers' own TrainClient), or a
    gateway's tcp:// or ipc:// address (client.frameworks.verifiers' GatewayTrainClient)."""
    if target.startswith(("tcp://", "ipc://")):
        from client import AsyncClient
        from client.frameworks.verifiers import GatewayTrainClient

        async with AsyncClient(target, name="verifiers") as gateway:
            done = await _rollout(lambda config: GatewayTrainClient(config, gateway), target,
                                  tokenizer, model)  # fmt: skip
            # A body the gateway refuses: the OpenAI SDK's error, as over HTTP.
            transport = GatewayTrainClient(_config(target, tokenizer), gateway).client
            body = {"model": model, "token_ids": [10**6], "sampling_params": {"max_tokens": 2}}
            try:
                await transport.post("/inference/v1/generate", body=body)
            except Exception as exc:  # noqa: BLE001 - reported, the test checks its type
                done["refused"] = [type(exc).__name__, getattr(exc, "status_code", None), str(exc)]
            # A short model name (not the gateway's, no adapter of that name): a 404 that
            # names the gateway's model (issue 81 item 4).
            short = {**body, "model": "tiny", "token_ids": [1]}
            try:
                await transport.post("/inference/v1/generate", body=short)
            except Exception as exc:  # noqa: BLE001
                done["unknown_model"] = [type(exc).__name__, getattr(exc, "status_code", None),
                                         str(exc)]  # fmt: skip
            return done
    from verifiers.v1.clients.train import TrainClient

    return await _rollout(TrainClient, target, tokenizer, model)


def _config(base_url: str, tokenizer: str):
    from renderers import DefaultRendererConfig
    from verifiers.v1.configs.client import TrainClientConfig

    return TrainClientConfig(
        base_url=f"{base_url}/v1",
        api_key_var="ENGINE_GATEWAY_TEST_TOKEN",
        # The tokenizer's own (ChatML) template: renderers' model-specific renderers need
        # their model's special tokens, and its default one takes no tool definitions.
        renderer=DefaultRendererConfig(),
        renderer_model_name=tokenizer,
    )


async def _rollout(make_client, base_url: str, tokenizer: str, model: str) -> dict:
    from verifiers.v1.clients.train import ElasticRendererPool
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    client = make_client(_config(base_url, tokenizer))
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
    target, tokenizer, model = sys.argv[1:4]
    try:
        print(json.dumps(asyncio.run(rollout(target, tokenizer, model))))
    except Exception as exc:  # the framework's own error, for the test to read
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))


if __name__ == "__main__":
    main()
