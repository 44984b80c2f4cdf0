"""SkyRL 0.3.0's own ``SkyRLGymGenerator``, as released, over client.frameworks.skyrl's
GatewayInferenceEngine (and, once, over SkyRL's RemoteInferenceClient through the face), on
skyrl-gym 0.4.0's multi-turn GSM8K environment, in the venv the setup makes for it
(``.venv-skyrl``), this repository on PYTHONPATH:

    .venv-skyrl/bin/python tests/client/http_face/skyrl_gym_rollout.py \\
        FACE_URL GATEWAY_ADDR MODEL TOKENIZER_DIR WEIGHTS_A WEIGHTS_B LORA_ONE LORA_TWO

The engine is made from the gateway's address with no event loop running, then used under
one ``asyncio.run`` after another, as SkyRL's entry point uses its inference client. The
trainer's side of a run, in order: full weights A pushed (``push_weights``, the cpu
backend) -> a rollout, the same rollout through RemoteInferenceClient -> weights B pushed ->
a rollout -> a LoRA synced as SkyRL's workers sync one (``update_named_weights`` with a
``LoraLoadRequest``, then the dispatch's ``increment_weight_version``) -> a rollout under
the adapter's name -> a second adapter synced under the same name -> a rollout. Then the
engine is left as it was found (adapter unloaded, A pushed back). Prints one JSON line: each
rollout's GeneratorOutput fields, the sampling parameters the trainer sent, the weight
versions the generator salted with, and the session ids finished.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

GROUND_TRUTH = "72"
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many"
    " clips in May. How many clips did Natalia sell altogether in April and May?",
    "Weng earns 12 an hour for babysitting. Yesterday, she just did 50 minutes of"
    " babysitting. How much did she earn?",
]
MAX_TURNS = 3
OUTPUT_FIELDS = ("prompt_token_ids", "response_ids", "loss_masks", "rollout_logprobs",
                 "rewards", "stop_reasons")  # fmt: skip


def _generator(engine, tokenizer, policy: str | None):  # noqa: ANN001, ANN202
    from skyrl.train.config import GeneratorConfig, SamplingParams, SkyRLGymConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

    config = GeneratorConfig(
        max_turns=MAX_TURNS,
        max_input_length=1500,
        batched=False,
        use_conversation_multi_turn=True,
        sampling_params=SamplingParams(max_generate_length=10, temperature=0.0, logprobs=0),
    )
    return SkyRLGymGenerator(
        generator_cfg=config,
        skyrl_gym_cfg=SkyRLGymConfig(max_env_workers=0),
        inference_engine_client=engine,
        tokenizer=tokenizer,
        policy_model_name=policy,
    )


async def rollout(engine, tokenizer, policy: str | None = None) -> dict:  # noqa: ANN001
    """One generate() of the generator, as SkyRL's trainer calls it: its sampling
    parameters made by SkyRL's own ``get_sampling_params_for_backend``."""
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import (
        get_sampling_params_for_backend,
    )
    from skyrl.train.generators.base import GeneratorInput, TrajectoryID

    generator = _generator(engine, tokenizer, policy)
    sampling = get_sampling_params_for_backend("vllm", generator.generator_cfg.sampling_params)
    batch = GeneratorInput(
        prompts=[[{"role": "user", "content": q}] for q in QUESTIONS],
        env_classes=["gsm8k_multi_turn"] * len(QUESTIONS),
        env_extras=[{"reward_spec": {"ground_truth": GROUND_TRUTH}} for _ in QUESTIONS],
        sampling_params=sampling,
        trajectory_ids=[TrajectoryID(instance_id=f"q{i}", repetition_id=0) for i in range(2)],
        batch_metadata=None,
    )
    finished = engine.finished = []
    salt = generator._compute_cache_salt()
    output = await generator.generate(batch, disable_tqdm=True)
    return {
        **{field: output[field] for field in OUTPUT_FIELDS},
        "sampling": sampling,
        "cache_salt": salt,
        "finished_sessions": sorted(finished),
    }


def _recording_sessions(engine_class):  # noqa: ANN001, ANN202
    """``engine_class`` whose finish_session also notes the id (the generator's call, seen)."""

    class Recording(engine_class):
        async def finish_session(self, session_id: str) -> None:
            self.finished.append(session_id)
            await super().finish_session(session_id)

    return Recording


def run(face: str, address: str, model: str, tokenizer_dir: str, weights_a: str,
        weights_b: str, lora_one: str, lora_two: str) -> dict:  # fmt: skip
    """As SkyRL's entry point drives its inference client: made with no event loop running
    (``get_inference_client()``), then used under one ``asyncio.run`` after another."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from client.frameworks.skyrl import GatewayInferenceEngine

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    state_a = load_file(str(Path(weights_a) / "model.safetensors"))
    state_b = load_file(str(Path(weights_b) / "model.safetensors"))
    engine = _recording_sessions(GatewayInferenceEngine)(address, model, tokenizer)
    out: dict = {}
    try:
        out.update(asyncio.run(base_weights(engine, tokenizer, face, model, state_a, state_b)))
        out.update(asyncio.run(adapters(engine, tokenizer, lora_one, lora_two)))
    finally:
        asyncio.run(restore(engine, state_a))
    return out


async def base_weights(engine, tokenizer, face: str, model: str, state_a, state_b) -> dict:  # noqa: ANN001
    """Full weights A pushed, a rollout, the same rollout over RemoteInferenceClient through
    the face; weights B pushed, a rollout."""
    import aiohttp
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import (
        RemoteInferenceClient,
    )

    out = {}
    await engine.push_weights(state_a.items(), version="skyrl-a")
    out["a"] = await rollout(engine, tokenizer)
    remote = _recording_sessions(RemoteInferenceClient)(
        proxy_url=face, server_urls=[face], data_parallel_size=1, model_name=model,
        tokenizer=tokenizer,
    )  # fmt: skip
    remote._session = aiohttp.ClientSession(  # the operator's token, as in FRAMEWORKS.md
        headers={"Authorization": f"Bearer {os.environ['ENGINE_GATEWAY_TEST_TOKEN']}"},
        timeout=aiohttp.ClientTimeout(total=None),
    )
    try:
        out["a_http"] = await rollout(remote, tokenizer)
    finally:
        await remote.aclose()
    await engine.push_weights(state_b.items(), version="skyrl-b")
    out["b"] = await rollout(engine, tokenizer)
    return out


async def adapters(engine, tokenizer, lora_one: str, lora_two: str) -> dict:  # noqa: ANN001
    """A LoRA synced as SkyRL's workers sync one, a rollout under its name; a second
    adapter under the same name, a rollout."""
    from skyrl.backends.skyrl_train.weight_sync import LoraLoadRequest

    out = {}
    for key, folder in (("lora_one", lora_one), ("lora_two", lora_two)):
        await engine.update_named_weights(LoraLoadRequest(lora_path=folder, lora_name="policy"))
        engine.increment_weight_version()  # as SkyRL's dispatch does after each sync
        out[key] = await rollout(engine, tokenizer, policy="policy")
    (gateway,) = engine.client.clients
    out["loras"] = await gateway.list_loras()
    try:
        await engine.update_named_weights(object())
    except NotImplementedError as exc:
        out["refused"] = str(exc)
    return out


async def restore(engine, state_a) -> None:  # noqa: ANN001
    """The engine as the test found it: no adapter, weights A; then the pool closed."""
    try:
        if "policy" in await engine.client.clients[0].list_loras():
            await engine.unload_lora_adapter("policy")
        await engine.push_weights(state_a.items(), version="skyrl-restored")
    finally:
        await engine.teardown()


def main() -> None:
    try:
        print(json.dumps(run(*sys.argv[1:9])))
    except Exception as exc:  # the framework's own error, for the test to read
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))


if __name__ == "__main__":
    main()
