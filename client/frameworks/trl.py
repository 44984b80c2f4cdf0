"""TRL's ``VLLMClient`` over the gateway's socket, with weight pushes: ``GatewayVLLMClient``.

TRL 1.16's ``GRPOTrainer`` (``vllm_mode="server"``) builds ``trl.generation.vllm_generation.
VLLMClient(base_url=...)`` and calls ``init_communicator``, ``generate`` (token-id prompts,
n, logprobs), ``update_named_params`` after each optimizer step, ``reset_prefix_cache`` and
``get_server_info``. TRL's own client syncs weights over NCCL (a TCP-store rendezvous the
gateway refuses, and on a CPU TRL refuses first); this one pushes them through the gateway's
weight-transfer messages with the ``cpu`` backend (``client.weight_sync``: engines started
with ``--weight-transfer-config '{"backend": "cpu"}'``, trainer on the same host). The one
line a training script adds, before building the trainer::

    trl.generation.vllm_generation.VLLMClient = GatewayVLLMClient

with ``GRPOConfig(vllm_server_base_url="tcp://gateway:5557", ...)``. Blocking, as TRL's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from client.errors import ClientError
from client.http_face.responses import candidate_rows, completion_candidates
from client.sync import Client
from client.tasks import all_or_none
from client.weight_sync import send_weights
from codec import Logprobs, SamplingParams

__all__ = ["GatewayVLLMClient"]


class GatewayVLLMClient:
    """TRL's VLLMClient, served by a gateway (``base_url``: its tcp:// or ipc:// address)."""

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
        *,
        client: Client | None = None,
        **client_kwargs: Any,
    ):
        if client is None:
            if base_url is None or not base_url.startswith(("tcp://", "ipc://")):
                raise ValueError(
                    f"GatewayVLLMClient needs the gateway's address as base_url (tcp:// or"
                    f" ipc://), got {base_url!r}"
                )
            client_kwargs.setdefault("connect_timeout_s", max(connection_timeout, 60.0))
            client = Client(base_url, name="trl", **client_kwargs)
        self.client = client
        self.base_url = base_url
        self.model = client.model_info().model.name
        self.weight_versions: list[str] = []  # the versions pushed, in order
        self._pushed = False  # a push opened the gateway's weight transfer (closed by close())

    # ---- what TRL reads of the server

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
        self.client.ping()

    def get_server_info(self) -> dict[str, Any]:
        """The fields TRL reads (``model_config``'s ``logprobs_mode``: vLLM's default, which
        the gateway's engines keep unless started otherwise)."""
        info = self.client.model_info().model
        return {
            "model_config": {
                "model": info.name,
                "max_model_len": info.max_model_len,
                "logprobs_mode": "raw_logprobs",
            },
            "weight_transfer_config": {"backend": "cpu"},
        }

    def get_world_size(self) -> int:
        return max(len(self.client.health().engines), 1)

    # ---- generation

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        features: list[dict | None] | None = None,
        n: int = 1,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        max_tokens: int = 16,
        logprobs: int | None = 0,
        structured_outputs_regex: str | None = None,
        generation_kwargs: dict | None = None,
    ) -> dict[str, list]:
        """As TRL's: ``prompt_ids``, ``completion_ids`` (prompt-major, n per prompt),
        ``logprobs`` and ``logprob_token_ids`` (per token, the sampled token and ``logprobs``
        more, by descending probability)."""
        if features is not None:
            raise NotImplementedError("GatewayVLLMClient.generate: image features (send images"
                                      " through client.multimodal_processor)")  # fmt: skip
        if structured_outputs_regex is not None:
            raise NotImplementedError("GatewayVLLMClient.generate: structured outputs are not"
                                      " served by the gateway")  # fmt: skip
        if any(isinstance(p, str) for p in prompts):
            raise ValueError("GatewayVLLMClient.generate: prompts must be token ids")
        extra = dict(generation_kwargs or {})
        for name in _TEXT_ONLY_KWARGS:  # shape text only: the ids are the same either way
            extra.pop(name, None)
        unknown = sorted(set(extra) - set(SamplingParams.__struct_fields__))
        if unknown:
            raise ValueError(
                f"GatewayVLLMClient.generate: generation_kwargs {unknown} are not sampling"
                " parameters the gateway serves (docs/REQUESTS.md lists them)"
            )
        fields = {
            "n": n,
            "repetition_penalty": repetition_penalty,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k if top_k > 0 else None,  # TRL's 0: no top-k (vLLM's -1)
            "min_p": min_p,
            "max_tokens": max_tokens,
            "logprobs": logprobs,
            **extra,
        }
        sampling = SamplingParams(**{k: v for k, v in fields.items() if v is not None})
        samples = self.client._run(self._all(prompts, sampling))  # type: ignore[arg-type]
        completions = [c for per_prompt in samples for c in per_prompt]
        out: dict[str, list] = {
            "prompt_ids": [list(p) for p in prompts],
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": None,  # type: ignore[dict-item]
            "logprob_token_ids": None,  # type: ignore[dict-item]
        }
        if logprobs is not None:
            rows = [_ranked(c.logprobs or Logprobs([], [], []), logprobs) for c in completions]
            out["logprobs"] = [[[v for _, v in r] for r in seq] for seq in rows]
            out["logprob_token_ids"] = [[[t for t, _ in r] for r in seq] for seq in rows]
        return out

    async def _all(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Any]]:
        """Every prompt's samples; one refused prompt aborts the batch's other requests."""
        samples = self.client._async.complete_samples
        return await all_or_none(samples(p, sampling) for p in prompts)

    def image_features(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's GRPO asks the server for a VLM's image features: not served here."""
        raise NotImplementedError(
            "GatewayVLLMClient.image_features: image features are not served over the"
            " gateway (send images with client.multimodal_processor: docs/IMAGES.md)"
        )

    def reset_prefix_cache(self) -> None:
        self.client.reset_prefix_cache()

    # ---- weights

    def init_communicator(self, device: Any = 0) -> None:
        """Nothing to set up: each push opens its own update (the ``cpu`` backend's buffer
        folder comes with it)."""

    def update_named_params(
        self, metadata: Any, named_params: Iterable[tuple[str, Any]], **_: Any
    ) -> None:
        """Push the trainer's parameters (TRL's vLLM names) in one update, pausing
        generation meanwhile (requests in flight go on under the new weights); the version
        is ``trl-update-K``, K counting the pushes that succeeded (a failed one raises and
        takes no version)."""
        version = f"trl-update-{len(self.weight_versions) + 1}"
        self._pushed = True
        send_weights(self.client, ((name, tensor.detach()) for name, tensor in named_params),
                     version=version)  # fmt: skip
        self.weight_versions.append(version)

    def update_named_param(self, name: str, weights: Any) -> None:
        self.update_named_params(None, [(name, weights)])

    def update_model_params(self, model: Any) -> None:
        self.update_named_params(None, model.named_parameters())

    def close_communicator(self) -> None:
        """Nothing to tear down (see init_communicator)."""

    def close(self) -> None:
        """Release the gateway's weight-transfer state (its shared-memory arena and buffer
        folder) if this client pushed weights, then end the session. Call it when training
        is over (TRL itself never does: its process exit ends the session otherwise)."""
        try:
            if self._pushed:
                with contextlib.suppress(ClientError):
                    self.client.shutdown_weight_transfer_engine()
                self._pushed = False
        finally:
            self.client.close()


# vLLM fields TRL may pass in generation_kwargs that shape only the text, which this client
# never makes (it answers ids): accepted and left out.
_TEXT_ONLY_KWARGS = ("skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens", "detokenize")  # fmt: skip


def _ranked(logprobs: Logprobs, top: int) -> list[list[tuple[int, float]]]:
    """Per token, the sampled token and ``top`` more candidates (the completions API's share),
    by descending logprob (as TRL parses vLLM's completions logprobs)."""
    return [
        sorted(((t, lp) for t, (lp, _) in completion_candidates(candidates, top)),
               key=lambda item: -item[1])
        for _, candidates in candidate_rows(logprobs)
    ]  # fmt: skip
