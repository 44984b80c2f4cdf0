"""One framework client's share of ``python -m bench.frameworks``, run in that framework's
venv (``.venv-trl``, ``.venv-skyrl``, ``.venv-verifiers``) with the repository on PYTHONPATH.

    python -m bench.framework_clients KIND TARGET MODEL TOKENIZER PROMPTS OUTPUT_LEN

KIND: ``trl-http`` / ``trl-native`` (TRL's VLLMClient / client.frameworks.trl),
``skyrl-http`` / ``skyrl-native``, ``verifiers-http`` / ``verifiers-native``, or
``trl-sync`` (one weight push of the model's own tensors through the native client, beside
a checkpoint write and ReloadWeights). TARGET: a base URL (``-http``) or a gateway address.
Generates PROMPTS greedy requests of OUTPUT_LEN tokens at once, as a trainer's batch, and
prints one JSON line: output tokens, wall seconds, and this process's CPU seconds (the
trainer side's cost).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time

TOKEN_ENV = "ENGINE_GATEWAY_BENCH_TOKEN"


def prompts_of(count: int, vocab: int = 500, length: int = 64) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def trl(kind: str, target: str, count: int, output_len: int) -> int:
    prompts = prompts_of(count)
    if kind == "trl-http":
        from trl.generation.vllm_client import VLLMClient

        client = VLLMClient(base_url=target)
    else:
        from client.frameworks.trl import GatewayVLLMClient

        client = GatewayVLLMClient(base_url=target)
    out = client.generate(prompts, n=1, temperature=0.0, max_tokens=output_len, logprobs=0,
                          generation_kwargs={"ignore_eos": True})  # fmt: skip
    return sum(len(c) for c in out["completion_ids"])


async def skyrl(kind: str, target: str, model: str, tokenizer_dir: str, count: int,
                output_len: int) -> int:  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    batch = {
        "prompt_token_ids": prompts_of(count),
        "sampling_params": {"temperature": 0.0, "max_tokens": output_len, "ignore_eos": True,
                            "logprobs": 0},
    }  # fmt: skip
    if kind == "skyrl-http":
        from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
            RemoteInferenceClient,
        )

        client = RemoteInferenceClient(proxy_url=target, server_urls=[target],
                                       data_parallel_size=1, model_name=model,
                                       tokenizer=tokenizer)  # fmt: skip
        try:
            done = await client.generate(batch)
        finally:
            await client.aclose()
    else:  # made from the address, as docs/FRAMEWORKS.md's get_inference_client makes it
        from client.frameworks.skyrl import GatewayInferenceEngine

        engine = await asyncio.to_thread(GatewayInferenceEngine, target, model, tokenizer)
        try:
            done = await engine.generate(batch)
        finally:
            await engine.teardown()
    return sum(len(ids) for ids in done["response_ids"])


async def verifiers(kind: str, target: str, model: str, tokenizer_dir: str, count: int,
                    output_len: int) -> int:  # fmt: skip
    from renderers import DefaultRendererConfig
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    base = target if kind == "verifiers-http" else "http://unused"
    config = TrainClientConfig(base_url=f"{base}/v1", api_key_var=TOKEN_ENV,
                               renderer=DefaultRendererConfig(),
                               renderer_model_name=tokenizer_dir)  # fmt: skip
    sampling = SamplingConfig(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rng = random.Random(0)

    async def rollouts(client) -> int:  # noqa: ANN001
        async def one(i: int) -> int:
            words = " ".join(rng.choice(["apples", "sea", "count", "blue"]) for _ in range(20))
            body = {"model": model, "messages": [{"role": "user", "content": f"{i} {words}"}]}
            response = await client.get_response(ChatDialect(), body, sampling,
                                                 session_id=f"s{i}")  # fmt: skip
            return len(response.tokens.completion_ids)

        return sum(await asyncio.gather(*(one(i) for i in range(count))))

    if kind == "verifiers-http":
        client = TrainClient(config)
        try:
            return await rollouts(client)
        finally:
            await client.close()
    from client import AsyncClient
    from client.frameworks.verifiers import GatewayTrainClient

    async with AsyncClient(target, name="bench-verifiers") as gateway:
        return await rollouts(GatewayTrainClient(config, gateway))


def trl_sync(target: str, model_dir: str) -> dict:
    """One push of the model's tensors through the native client, beside writing them as a
    checkpoint and reloading it (ReloadWeights), the other way a trainer updates vLLM."""
    import torch
    from transformers import AutoModelForCausalLM

    from client.frameworks.trl import GatewayVLLMClient

    client = GatewayVLLMClient(base_url=target)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    started = time.perf_counter()
    client.update_named_params(None, model.named_parameters())
    push_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        model.save_pretrained(folder)
        write_s = time.perf_counter() - started
        client.client.reload_weights(folder, version="from-checkpoint")
        reload_s = time.perf_counter() - started - write_s
    return {"push_s": push_s, "write_s": write_s, "reload_s": reload_s}


def main() -> None:
    kind, target, model, tokenizer_dir, count, output_len = sys.argv[1:7]
    count_i, output_i = int(count), int(output_len)
    if kind == "trl-sync":
        print(json.dumps(trl_sync(target, model)))
        return

    def run(prompts: int) -> int:
        if kind.startswith("trl"):
            return trl(kind, target, prompts, output_i)
        if kind.startswith("skyrl"):
            return asyncio.run(skyrl(kind, target, model, tokenizer_dir, prompts, output_i))
        return asyncio.run(verifiers(kind, target, model, tokenizer_dir, prompts, output_i))

    run(2)  # imports, connections, the renderer: not the batch's cost
    # What the imports made (torch's and vLLM's objects where a venv has them: 350-680k)
    # is frozen out of the collector: a full collection of them (0.2-0.4 s) would land in
    # one client's window by chance and be counted as that client's cost.
    gc.collect()
    gc.freeze()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    tokens = run(count_i)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    print(json.dumps({"kind": kind, "tokens": tokens, "wall_s": wall, "cpu_s": cpu,
                      "pid": os.getpid()}))  # fmt: skip


if __name__ == "__main__":
    main()
