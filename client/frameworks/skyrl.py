"""SkyRL's ``InferenceEngineInterface`` over the gateway's socket: ``GatewayInferenceEngine``.

SkyRL 0.3.0's generators (``SkyRLGymGenerator``) drive one inference client, documented as
overridable (``get_inference_client()`` in ``train/entrypoints/main_base.py``); its HTTP one
is ``RemoteInferenceClient``. This one serves the same calls from the gateways' addresses
(usable from any event loop, as SkyRL calls it) or an AsyncClient or GatewayPool you own:
token-in/token-out ``generate`` (session ids as routing keys, cache salts, logprobs, LoRA
by model name), pause/resume, sleep/wake_up, reset_prefix_cache, world size, the policy's
``weight_version`` (the generator's cache salt).
Responses' text is decoded with the tokenizer given, as SkyRL's contract says
(``skip_special_tokens=True``). Weights: SkyRL's LoRA sync (its workers' ``LoraLoadRequest``
to ``update_named_weights``, or ``load_lora_adapter`` as on its HTTP client) loads the
adapter on every gateway, reloading a name already loaded; full weights go with
``push_weights`` (the gateway's ``cpu`` backend). SkyRL's NCCL-broadcast and CUDA-IPC
strategies are not served (``NotImplementedError`` naming the call).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from typing import Any

from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInput,
    InferenceEngineInterface,
    InferenceEngineOutput,
)

from client.any_loop import pool_on_own_loop
from client.http_face.bodies import HttpError, sampling_from
from client.http_face.responses import finish_reason_name, logprobs_content
from client.tasks import all_or_none
from client.weight_sync import asend_weights
from codec import RequestOptions
from codec.framing import cache_salt_problem

__all__ = ["GatewayInferenceEngine", "vllm_cache_salt"]


def vllm_cache_salt(salt: str | None) -> str | None:
    """SkyRL's cache salt as one vLLM 0.32 accepts. SkyRLGymGenerator salts with
    ``"<policy>@<weight version>"`` when it names a policy (a LoRA adapter), and vLLM 0.32
    refuses ``@`` (SkyRL 0.3.0 pins vLLM 0.23, which did not): such a salt, or one too
    long, goes as ``skyrl-`` and its SHA-256, one salt per SkyRL salt, so the blocks of
    each policy version stay apart as SkyRL means them to. Others go as they are."""
    if not salt or cache_salt_problem(salt) is None:
        return salt
    return "skyrl-" + hashlib.sha256(salt.encode()).hexdigest()


class GatewayInferenceEngine(InferenceEngineInterface):
    """SkyRL's inference client, served by gateways.

    ``client``: the gateways' addresses (a str or a list), connected here on a loop of the
    engine's own (``client.any_loop``), so that it serves calls from any event loop, as
    SkyRL makes them (``get_inference_client()`` runs with no loop, its trainer under
    ``asyncio.run``); ``teardown()`` closes it. Or an AsyncClient or GatewayPool you
    connected and own, used from its own loop only."""

    def __init__(
        self,
        client: Any,
        model_name: str,
        tokenizer: Any = None,
        *,
        uses_lora_weight_sync: bool = False,
        enable_return_routed_experts: bool = False,
        **pool_kwargs: Any,
    ):
        if enable_return_routed_experts:
            raise NotImplementedError(
                "GatewayInferenceEngine: enable_return_routed_experts (router replay: the"
                " gateway does not return routed experts; without them SkyRL would train"
                " without replay)"
            )
        self._owned = isinstance(client, (str, list, tuple))
        if self._owned:
            pool_kwargs.setdefault("name", "skyrl")
            client = pool_on_own_loop(client, **pool_kwargs)
        elif pool_kwargs:
            raise TypeError(f"pool options {sorted(pool_kwargs)} need addresses, not a client")
        self.client = client
        self._model_name = model_name
        self.tokenizer = tokenizer
        # As RemoteInferenceClient's: a trainer that syncs only LoRA adapters keeps the base
        # weights through sleep (level 1), since nothing would bring them back on wake_up.
        self.uses_lora_weight_sync = uses_lora_weight_sync
        self._weight_version = 0

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def weight_version(self) -> int:
        """Weight syncs so far (0 before the first), as ``RemoteInferenceClient`` counts them:
        ``SkyRLGymGenerator`` salts the prefix cache with it."""
        return self._weight_version

    def increment_weight_version(self) -> None:
        """One more completed sync (SkyRL's dispatch calls it after each; ``push_weights``
        counts its own)."""
        self._weight_version += 1

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
        if fields.get("n") is None:  # absent or null: one sample, as vLLM's default
            fields.pop("n", None)
        elif not isinstance(fields["n"], int) or isinstance(fields["n"], bool):
            raise ValueError(
                f"GatewayInferenceEngine.generate: n must be an integer, got {fields['n']!r}"
            )
        elif fields["n"] > 1:
            raise ValueError("n > 1 is not supported. Use `n_samples_per_prompt`, as SkyRL says.")
        try:
            sampling = sampling_from(fields)
        except HttpError as exc:
            raise ValueError(f"GatewayInferenceEngine.generate: {exc.message}") from None
        sessions = input_batch.get("session_ids") or []
        lora = None if model in (None, self._model_name) else model
        salt = vllm_cache_salt(input_batch.get("cache_salt"))

        async def one(i: int) -> Any:
            key = str(sessions[i]) if i < len(sessions) and sessions[i] is not None else None
            options = RequestOptions(cache_salt=salt, lora_name=lora, routing_key=key)
            (completion,) = await self.client.complete_samples(ids[i], sampling, options=options)
            return completion

        done = await all_or_none(one(i) for i in range(len(ids)))  # one refused: all aborted
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
        """vLLM's sleep on every gateway's engines; level 1 whatever is asked when the
        trainer syncs only LoRA adapters (``uses_lora_weight_sync``), as SkyRL's own client."""
        level = 1 if self.uses_lora_weight_sync else level
        await asyncio.gather(*(c.sleep(level) for c in self._each()))

    async def wake_up(self, tags: list[str] | None = None, **_: Any) -> None:
        await asyncio.gather(*(c.wake_up(tags) for c in self._each()))

    async def init_weight_update_communicator(self, init_info: Any) -> None:
        raise NotImplementedError(
            "GatewayInferenceEngine.init_weight_update_communicator: SkyRL's NCCL and CUDA-IPC"
            " strategies are not served; push weights with push_weights (the cpu backend)"
        )

    async def update_named_weights(self, request: Any) -> None:
        """SkyRL's workers send a ``LoraLoadRequest`` here (a PEFT folder they wrote): it is
        loaded under its ``lora_name``. Tensor-carrying requests (NCCL, CUDA IPC) are not
        served."""
        lora_path = getattr(request, "lora_path", None)
        if not lora_path:
            raise NotImplementedError(
                f"GatewayInferenceEngine.update_named_weights: {type(request).__name__} (SkyRL's"
                " NCCL and CUDA-IPC strategies are not served; push full weights with"
                " push_weights, the cpu backend)"
            )
        name = getattr(request, "lora_name", "") or ""
        if not name:
            raise ValueError(
                "GatewayInferenceEngine.update_named_weights: a LoraLoadRequest needs a"
                " lora_name (the gateway serves adapters by name)"
            )
        await self.load_lora_adapter(name, lora_path)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load (or reload: SkyRL syncs an adapter under one name each step) ``lora_path``
        as ``lora_name`` on every gateway; requests name it by ``model``. A request naming
        it between the unload and the load of a reload is refused, not served by other
        weights."""

        async def one(client: Any) -> None:
            if lora_name in await client.list_loras():
                await client.unload_lora(lora_name)
            await client.load_lora(lora_name, lora_path)

        await asyncio.gather(*(one(c) for c in self._each()))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await asyncio.gather(*(c.unload_lora(lora_name) for c in self._each()))

    async def push_weights(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> None:
        """The trainer's tensors (checkpoint names) into every gateway's engines, through the
        ``cpu`` weight-transfer backend (trainer and engines on one host); the weight
        version advances once it is done."""
        tensors = list(named_tensors)
        await asyncio.gather(*(asend_weights(c, tensors, version=version) for c in self._each()))
        self.increment_weight_version()

    async def teardown(self) -> None:
        """Close the gateways' pool made from addresses (its live requests are aborted);
        a client given is the caller's, and stays open."""
        if self._owned:
            await self.client.aclose()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await asyncio.gather(
            *(c.reset_prefix_cache(reset_running=reset_running_requests) for c in self._each())
        )

    async def pause(self, mode: Any = "keep", clear_cache: bool = False) -> None:
        """Pause every gateway's engines: ``keep``, ``wait`` or ``abort``, as
        RemoteInferenceClient.pause (its PauseMode or the string)."""
        mode = str(getattr(mode, "value", mode)).lower()
        await asyncio.gather(*(c.pause(mode, clear_cache=clear_cache) for c in self._each()))

    async def resume(self) -> None:
        await asyncio.gather(*(c.resume() for c in self._each()))

    async def pause_generation(self, clear_cache: bool = False) -> None:
        await self.pause("keep", clear_cache=clear_cache)

    async def resume_generation(self) -> None:
        await self.resume()

    async def finish_session(self, session_id: str) -> None:
        """Nothing to release: the gateway's routing keys age out by themselves."""

    async def get_world_size(self) -> tuple[int, int]:
        healths = await asyncio.gather(*(c.health() for c in self._each()))
        per_gateway = max(len(healths[0].engines), 1) if healths else 1
        return per_gateway * len(healths), per_gateway
