"""SkyRL's ``InferenceEngineInterface`` over the gateway's socket: ``GatewayInferenceEngine``.

SkyRL 0.3.0's generators (``SkyRLGymGenerator``) drive one inference client, documented as
overridable (``get_inference_client()`` in ``train/entrypoints/main_base.py``); its HTTP one
is ``RemoteInferenceClient``. This one serves the same calls from an AsyncClient or
GatewayPool you own: token-in/token-out ``generate`` (session ids as routing keys, cache
salts, logprobs, LoRA by model name), pause/resume (keep), sleep/wake_up,
reset_prefix_cache, world size. Responses' text is decoded with the tokenizer given, as
SkyRL's contract says (``skip_special_tokens=True``). SkyRL's own weight-sync strategies
(NCCL broadcast, CUDA IPC) are not served (``NotImplementedError`` naming the call); push
weights with ``push_weights`` (the gateway's ``cpu`` backend) instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)

from client.http_face.bodies import HttpError, sampling_from
from client.http_face.responses import finish_reason_name, logprobs_content
from client.weight_sync import asend_weights
from codec import RequestOptions

__all__ = ["GatewayInferenceEngine"]


class GatewayInferenceEngine(InferenceEngineInterface):
    """SkyRL's inference client, served by a gateway (``client``: AsyncClient or pool)."""

    def __init__(self, client: Any, model_name: str, tokenizer: Any = None):
        self.client = client
        self._model_name = model_name
        self.tokenizer = tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    def _each(self) -> list[Any]:
        return [c for c in getattr(self.client, "clients", [self.client]) if c.connected]

    async def generate(
        self, input_batch: InferenceEngineInput, model: str | None = None
    ) -> InferenceEngineOutput:
        ids = input_batch.get("prompt_token_ids")
        if ids is None:
            raise NotImplementedError(
                "GatewayInferenceEngine.generate: prompts as conversations (render them to"
                " prompt_token_ids, as token-in/token-out training does)"
            )
        if input_batch.get("mm_features"):
            raise NotImplementedError("GatewayInferenceEngine.generate: multimodal features")
        fields = dict(input_batch.get("sampling_params") or {})
        if fields.get("n", 1) > 1:
            raise ValueError("n > 1 is not supported. Use `n_samples_per_prompt`, as SkyRL says.")
        try:
            sampling = sampling_from(fields)
        except HttpError as exc:
            raise ValueError(f"GatewayInferenceEngine.generate: {exc.message}") from None
        sessions = input_batch.get("session_ids") or []
        lora = None if model in (None, self._model_name) else model
        salt = input_batch.get("cache_salt")

        async def one(i: int) -> Any:
            key = str(sessions[i]) if i < len(sessions) and sessions[i] is not None else None
            options = RequestOptions(cache_salt=salt, lora_name=lora, routing_key=key)
            (completion,) = await self.client.complete_samples(ids[i], sampling, options=options)
            return completion

        done = await asyncio.gather(*(one(i) for i in range(len(ids))))
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return InferenceEngineOutput(
            responses=[
                decode(c.token_ids, skip_special_tokens=True) if decode else "" for c in done
            ],
            response_ids=[c.token_ids for c in done],
            stop_reasons=[finish_reason_name(c.finish_reason) for c in done],
            response_logprobs=(
                [
                    [e["logprob"] for e in logprobs_content(c.logprobs, 0)] if c.logprobs else []
                    for c in done
                ]  # fmt: skip
                if sampling.logprobs is not None
                else None
            ),
            prompt_logprobs=None,
            rollout_expert_indices=None,
        )

    def get_endpoint_url(self) -> str:
        raise NotImplementedError(
            "GatewayInferenceEngine.get_endpoint_url: no HTTP endpoint (serve one with"
            " `engine-gateway http` and give its URL to the clients that need one)"
        )

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("GatewayInferenceEngine.chat_completion: render with the"
                                  " tokenizer's chat template and call generate")  # fmt: skip

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("GatewayInferenceEngine.render_chat_completion: render in"
                                  " the trainer (client.text's Conversation)")  # fmt: skip

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("GatewayInferenceEngine.completion: call generate with"
                                  " prompt_token_ids")  # fmt: skip

    async def sleep(self, level: int = 2, tags: list[str] | None = None, **_: Any) -> None:
        await asyncio.gather(*(c.sleep(level) for c in self._each()))

    async def wake_up(self, tags: list[str] | None = None, **_: Any) -> None:
        await asyncio.gather(*(c.wake_up(tags) for c in self._each()))

    async def init_weight_update_communicator(self, init_info: Any) -> None:
        raise NotImplementedError(
            "GatewayInferenceEngine.init_weight_update_communicator: SkyRL's NCCL and CUDA-IPC"
            " strategies are not served; push weights with push_weights (the cpu backend)"
        )

    async def update_named_weights(self, request: Any) -> None:
        raise NotImplementedError(
            "GatewayInferenceEngine.update_named_weights: use push_weights (the cpu backend)"
        )

    async def push_weights(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> None:
        """The trainer's tensors (checkpoint names) into every gateway's engines, through the
        ``cpu`` weight-transfer backend (trainer and engines on one host)."""
        tensors = list(named_tensors)
        await asyncio.gather(*(asend_weights(c, tensors, version=version) for c in self._each()))

    async def teardown(self) -> None:
        """The gateway client is the caller's: it stays open."""

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await asyncio.gather(
            *(c.reset_prefix_cache(reset_running=reset_running_requests) for c in self._each())
        )

    async def pause_generation(self) -> None:
        await asyncio.gather(*(c.pause("keep") for c in self._each()))

    async def resume_generation(self) -> None:
        await asyncio.gather(*(c.resume() for c in self._each()))

    async def finish_session(self, session_id: str) -> None:
        """Nothing to release: the gateway's routing keys age out by themselves."""

    async def get_world_size(self) -> tuple[int, int]:
        healths = await asyncio.gather(*(c.health() for c in self._each()))
        per_gateway = max(len(healths[0].engines), 1) if healths else 1
        return per_gateway * len(healths), per_gateway
