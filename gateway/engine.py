"""The engine boundary: a small Protocol the gateway drives, and neutral types.

Rule: nothing here imports vLLM. ``gateway.vllm.VllmEngine`` implements the
Protocol on a real EngineCore; ``fake_engine.FakeEngine`` implements it in
process for unit tests and the gateway's own benchmark ceiling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from codec import Generate, ItemSchema, Logprobs

__all__ = [
    "EngineInfo",
    "PrefillStatsLike",
    "EngineEventLike",
    "PreparedRequest",
    "StepOutput",
    "Engine",
    "sample_engine_request_id",
]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the gateway needs to know of the served model and engine."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_logprobs: int
    max_num_seqs: int
    # vLLM's CPU attention kernels for this model here (amx, vec, vec16, ...); None off CPU.
    cpu_attention: str | None = None
    # Per modality a Generate's multimodal items may carry, what an item must be (the
    # engine checks it; PROTOCOL.md §7.16).
    multimodal: Mapping[str, ItemSchema] = field(default_factory=dict)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(sorted(self.multimodal))


class PrefillStatsLike(Protocol):
    num_cached_tokens: int  # local prefix cache and KV connector together
    num_external_cached_tokens: int  # of those, loaded through a KV connector


class EngineEventLike(Protocol):
    type: int
    timestamp: float  # monotonic seconds, on the engine's host


class PreparedRequest(Protocol):
    """A validated request for one sample, ready for ``add_requests``."""

    @property
    def request_id(self) -> str: ...


class StepOutput(Protocol):
    """One request's output from one engine step; names follow vLLM's EngineCoreOutput.

    ``new_logprobs`` and ``new_prompt_logprobs_tensors`` are already wire
    ``Logprobs`` (the adapter converts vLLM's arrays), or None.
    """

    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> int | None: ...
    @property
    def stop_reason(self) -> int | str | None: ...
    @property
    def new_logprobs(self) -> Logprobs | None: ...
    @property
    def new_prompt_logprobs_tensors(self) -> Logprobs | None: ...
    @property
    def prefill_stats(self) -> PrefillStatsLike | None: ...
    @property
    def kv_transfer_params(self) -> dict | None:
        """On the final output: what a KV connector returns for the next engine (P/D)."""
        ...

    @property
    def events(self) -> Sequence[EngineEventLike] | None:
        """vLLM's EngineCoreEvents (QUEUED=1, SCHEDULED=2), when the engine records them."""
        ...


class Engine(Protocol):
    """What the gateway needs from an engine: vLLM's method names minus ``_async``."""

    info: EngineInfo
    weight_version: str | None  # the engine's weight version for the latest step returned

    def prepare(self, engine_request_id: str, request: Generate) -> Sequence[PreparedRequest]:
        """Validate and build one engine request per sample (n of them).

        Raises:
            RequestRejected: the request is invalid; the message is vLLM's.
        """
        ...

    async def add_requests(self, prepared: Sequence[PreparedRequest]) -> None:
        """Submit prepared requests, in order.

        Raises:
            SubmitFailed: one request could not be submitted (the engine is alive).
            EngineDead: the engine process is gone.
        """
        ...

    async def abort_requests(self, engine_request_ids: Sequence[str]) -> None:
        """Stop requests in the engine; unknown ids are ignored."""
        ...

    async def get_output(self) -> Sequence[StepOutput]:
        """Wait for the next engine step's outputs. Raises EngineDead."""
        ...

    async def run_outputs(self, on_step: Callable[[Sequence[StepOutput]], None]) -> None:
        """Call ``on_step`` on the event loop with each step's outputs, in order, until
        the engine dies: then raise EngineDead. An exception from ``on_step`` ends the
        call and is raised from it. The gateway uses this, not ``get_output``; an engine
        uses one or the other for its whole life."""
        ...

    async def aclose(self) -> None:
        """Stop the engine and release its resources."""
        ...

    # Optional: ``engine_load() -> list[EngineLoad]``, each engine's running and waiting
    # requests for HealthReply (the gateway uses it when the engine has it).


class ControlUnsupported(NotImplementedError):
    """This engine has no such control operation (answered UNSUPPORTED, with the reason)."""


class EngineControls:
    """The control operations an engine may offer, each unsupported until it overrides it.

    The server maps ``NotImplementedError`` (this class's ``ControlUnsupported``, or an
    engine's own reason) to UNSUPPORTED, and nothing else: an AttributeError raised inside
    vLLM is a failure (INTERNAL), not a missing feature."""

    def _unsupported(self, operation: str) -> ControlUnsupported:
        return ControlUnsupported(f"{type(self).__name__} does not offer {operation}")

    async def pause(self, mode: str, clear_cache: bool) -> None:
        raise self._unsupported("pause")

    async def resume(self) -> None:
        raise self._unsupported("resume")

    async def reset_prefix_cache(self, reset_running: bool) -> bool:
        raise self._unsupported("reset_prefix_cache")

    async def reload_weights(self, path: str, version: str | None) -> dict:
        raise self._unsupported("reload_weights")

    async def set_weight_version(self, version: str) -> None:
        raise self._unsupported("set_weight_version")

    async def sleep(self, level: int) -> None:
        raise self._unsupported("sleep")

    async def wake_up(self, tags: list[str] | None) -> None:
        raise self._unsupported("wake_up")

    async def load_lora(self, name: str, path: str) -> None:
        raise self._unsupported("load_lora")

    async def unload_lora(self, name: str) -> None:
        raise self._unsupported("unload_lora")

    async def list_loras(self) -> list[str]:
        raise self._unsupported("list_loras")

    async def init_weight_transfer(self, init_info: dict) -> dict | None:
        """vLLM's init_weight_transfer_engine; the backend's result for the client."""
        raise self._unsupported("weight transfer")

    async def start_weight_update(self, hold: bool, mode: str = "keep") -> None:
        """Open a weight update; ``hold``: pause generation (vLLM's ``mode``) until it ends."""
        raise self._unsupported("weight transfer")

    async def update_weights(self, update_info: dict | list) -> None:
        raise self._unsupported("weight transfer")

    async def finish_weight_update(self, version: str | None) -> dict:
        raise self._unsupported("weight transfer")

    async def shutdown_weight_transfer(self) -> None:
        raise self._unsupported("weight transfer")

    async def abandon_weight_update(self, reason: str) -> None:
        """End the open update from the gateway's side (its trainer is gone or stalled).
        Raises WeightsIncomplete when layers had taken new weights already."""
        raise self._unsupported("weight transfer")

    async def release_weight_hold(self) -> None:
        """Let generation run again after a failed update (the server calls it once it
        ended the requests a half-updated model may not serve)."""

    def engine_stats(self) -> list:
        """Per-engine scheduler stats for GetStats; none by default."""
        return []

    async def encoder_cache_counts(self) -> dict[str, int]:
        """Multimodal encoder cache counts (``encoder_cache_hits``, ``encoder_runs``) summed
        over the engines, for GetStats and the metrics; none by default."""
        return {}


def sample_engine_request_id(engine_request_id: str, index: int, n: int) -> str:
    """The engine id of sample ``index`` of an ``n``-sample request (vLLM's scheme)."""
    return engine_request_id if n == 1 else f"{index}_{engine_request_id}"
