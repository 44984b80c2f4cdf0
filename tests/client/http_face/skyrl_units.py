"""client.frameworks.skyrl's GatewayInferenceEngine on its own, in ``.venv-skyrl`` (SkyRL
imports there), over a stand-in gateway client that records the calls it is given (no
engine: what the adapter asks the gateway for, per SkyRL call). Prints one JSON line.

    .venv-skyrl/bin/python tests/client/http_face/skyrl_units.py
"""

from __future__ import annotations

import asyncio
import json
from typing import Any


class RecordingGateway:
    """The AsyncClient calls the adapter makes, recorded; LoRA names kept as a gateway would."""

    connected = True

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.loras: set[str] = set()

    async def sleep(self, level: int) -> None:
        self.calls.append(["sleep", level])

    async def pause(self, mode: str, *, clear_cache: bool = False) -> None:
        self.calls.append(["pause", mode, clear_cache])

    async def resume(self) -> None:
        self.calls.append(["resume"])

    async def list_loras(self) -> list[str]:
        return sorted(self.loras)

    async def load_lora(self, name: str, path: str) -> None:
        assert name not in self.loras, "a gateway refuses a name already loaded"
        self.loras.add(name)
        self.calls.append(["load_lora", name, path])

    async def unload_lora(self, name: str) -> None:
        self.loras.remove(name)
        self.calls.append(["unload_lora", name])

    async def complete_samples(self, ids: list[int], sampling: Any, *, options: Any) -> list:
        """A prompt [666] is refused at once; the others run until cancelled (recorded:
        a cancelled call's request is aborted by its stream's close)."""
        self.calls.append(["generate", ids, sampling.n])
        if ids == [666]:
            raise ValueError("refused: id 666")
        if ids == [7]:
            from client.results import Completion
            from codec import FinishReason

            return [Completion("r", 0, [8, 9], FinishReason.LENGTH, None, 1, 2, 0)]
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.calls.append(["cancelled", ids])
            raise
        return []


async def run() -> dict:
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import PauseMode
    from skyrl.backends.skyrl_train.weight_sync import LoraLoadRequest
    from skyrl.backends.skyrl_train.weight_sync.broadcast_strategy import (
        BroadcastWeightUpdateRequest,
    )

    from client.frameworks.skyrl import GatewayInferenceEngine, vllm_cache_salt

    out: dict = {}
    for lora_only in (False, True):
        gateway = RecordingGateway()
        engine = GatewayInferenceEngine(gateway, "m", uses_lora_weight_sync=lora_only)
        await engine.sleep()  # SkyRL's trainer: level 2 by default
        await engine.pause(mode=PauseMode.ABORT, clear_cache=True)
        await engine.pause("wait")
        await engine.pause_generation()
        await engine.resume_generation()
        out[f"calls_lora_only_{lora_only}"] = gateway.calls

    gateway = RecordingGateway()
    engine = GatewayInferenceEngine(gateway, "m")
    for path in ("/adapters/one", "/adapters/two"):  # a sync each step, one name
        await engine.update_named_weights(LoraLoadRequest(lora_path=path, lora_name="policy"))
    out["lora_calls"] = gateway.calls
    refusals = []
    for request in (
        BroadcastWeightUpdateRequest(names=["w"], dtypes=["bfloat16"], shapes=[[2]]),
        LoraLoadRequest(lora_path="/adapters/one"),  # no name
    ):
        try:
            await engine.update_named_weights(request)
        except (NotImplementedError, ValueError) as exc:
            refusals.append([type(exc).__name__, str(exc)])
    try:
        GatewayInferenceEngine(RecordingGateway(), "m", enable_return_routed_experts=True)
    except NotImplementedError as exc:
        refusals.append([type(exc).__name__, str(exc)])
    out["refusals"] = refusals
    gateway = RecordingGateway()
    engine = GatewayInferenceEngine(gateway, "m")
    done = await engine.generate({"prompt_token_ids": [[7]], "sampling_params": {"n": None}})
    out["n_null"] = [done["response_ids"], gateway.calls]
    gateway = RecordingGateway()
    engine = GatewayInferenceEngine(gateway, "m")
    try:
        await asyncio.wait_for(
            engine.generate({"prompt_token_ids": [[1], [2], [666]], "sampling_params": {}}), 10
        )
    except ValueError as exc:
        out["batch_refused"] = [str(exc), gateway.calls]
    out["salts"] = {
        salt: vllm_cache_salt(salt)
        for salt in ("3", "policy@3", "policy@4", "a/b", "x" * 128, "x" * 129)
    }
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run())))
