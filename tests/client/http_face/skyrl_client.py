"""SkyRL 0.3.0's own ``RemoteInferenceClient``, as released, against the face, in the venv the
setup makes for it (``.venv-skyrl``, Python 3.12: SkyRL 0.3.0 does not import on 3.11).

    .venv-skyrl/bin/python tests/client/http_face/skyrl_client.py BASE_URL MODEL TOKENIZER_DIR
    .venv-skyrl/bin/python tests/client/http_face/skyrl_client.py native ADDR MODEL TOKENIZER_DIR

(``native``: client.frameworks.skyrl's GatewayInferenceEngine over the gateway's socket, the
repository on PYTHONPATH.)

Drives it as SkyRL's generator does: a batch of token-id prompts with session ids and
logprobs, pause (keep) with a request in flight and resume, reset_prefix_cache, sleep (the
CPU engine has no sleep mode: SkyRL's own error is reported), world size. The face's
control routes need the operator's token, which SkyRL's client does not send: its
``aiohttp`` session is given one header (``ENGINE_GATEWAY_TEST_TOKEN``). Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys


async def run(base_url: str, model: str, tokenizer_dir: str) -> dict:
    import aiohttp
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )
    from transformers import AutoTokenizer

    client = RemoteInferenceClient(
        proxy_url=base_url,
        server_urls=[base_url],
        data_parallel_size=1,
        model_name=model,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
    )
    token = os.environ["ENGINE_GATEWAY_TEST_TOKEN"]
    client._session = aiohttp.ClientSession(  # the one line a user adds: the operator's token
        headers={"Authorization": f"Bearer {token}"},
        timeout=aiohttp.ClientTimeout(total=None),
    )
    out: dict = {}
    try:
        batch = {
            "prompt_token_ids": [[5, 6, 7], [8, 9]],
            "sampling_params": {"temperature": 0.0, "max_tokens": 8, "logprobs": 1},
            "session_ids": ["episode-1", "episode-2"],
        }
        done = await client.generate(batch)
        out["response_ids"] = done["response_ids"]
        out["response_logprobs"] = done["response_logprobs"]
        out["stop_reasons"] = done["stop_reasons"]
        out["responses"] = done["responses"]
        long = {
            "prompt_token_ids": [[3, 4]],
            "sampling_params": {"temperature": 0.0, "max_tokens": 480, "ignore_eos": True},
        }
        running = asyncio.ensure_future(client.generate(long))
        await asyncio.sleep(0.3)
        await client.pause(mode="keep")
        await client.resume()
        across = await running
        out["across_tokens"] = len(across["response_ids"][0])
        out["rollout"] = await multi_turn(client, client.tokenizer)
        out["reset_prefix_cache"] = await client.reset_prefix_cache()
        out["world_size"] = list(await client.get_world_size())
        try:
            await client.sleep(level=1)
            out["sleep"] = "slept"
        except Exception as exc:
            out["sleep"] = f"{type(exc).__name__}: {exc}"
    finally:
        await client.aclose()
    return out


async def multi_turn(engine, tokenizer) -> list:  # noqa: ANN001
    """Two episodes of three turns, as SkyRLGymGenerator runs them: each turn generates
    from the episode's ids so far (its session id the routing key), the environment's
    observation is appended as tokens, and the episode's session is finished at its end."""
    episodes = []
    for episode in range(2):
        ids = [5 + episode, 6, 7]
        turns = []
        for turn in range(3):
            batch = {
                "prompt_token_ids": [ids],
                "sampling_params": {"temperature": 0.0, "max_tokens": 6, "logprobs": 0},
                "session_ids": [f"episode-{episode}"],
            }
            done = await engine.generate(batch)
            response = done["response_ids"][0]
            turns.append([ids, response, done["response_logprobs"][0], done["stop_reasons"][0]])
            ids = ids + response + tokenizer.encode(f" observation {turn}")
        await engine.finish_session(f"episode-{episode}")
        episodes.append(turns)
    return episodes


async def native(address: str, model: str, tokenizer_dir: str) -> dict:
    """The same rollout through client.frameworks.skyrl's GatewayInferenceEngine."""
    from transformers import AutoTokenizer

    from client import AsyncClient
    from client.frameworks.skyrl import GatewayInferenceEngine

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    async with AsyncClient(address, name="skyrl") as gateway:
        engine = GatewayInferenceEngine(gateway, model, tokenizer)
        rollout = await multi_turn(engine, tokenizer)
        await engine.pause_generation()
        await engine.resume_generation()
        return {"rollout": rollout, "world_size": list(await engine.get_world_size())}


def main() -> None:
    try:
        if sys.argv[1] == "native":
            print(json.dumps(asyncio.run(native(*sys.argv[2:5])), default=str))
            return
        print(json.dumps(asyncio.run(run(*sys.argv[1:4])), default=str))
    except Exception as exc:  # SkyRL's own error, for the test to read
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))


if __name__ == "__main__":
    main()
