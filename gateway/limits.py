"""The gateway's configurable limits, and what HelloAck tells clients of them and the model."""

from __future__ import annotations

from dataclasses import dataclass, replace

from codec import Limits, ModelInfo

from .engine import EngineInfo

__all__ = ["GatewayLimits", "frame_limit_for", "model_info", "wire_limits"]


def frame_limit_for(max_model_len: int) -> int:
    """The default ``max_frame_bytes``: room for the largest valid Generate of a model with
    this context (a prompt of ``max_model_len`` ids at up to 5 msgpack bytes each) plus
    64 KiB for sampling fields and options. A frame's decode holds the event loop (every
    list is bounded from its header, codec.bounds; what is left scales with the frame), so
    the limit grows with what the model can take, no further."""
    return 5 * max_model_len + 64 * 1024


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """Configurable limits; all reported to clients in HelloAck.limits."""

    max_frame_bytes: int | None = None  # None: frame_limit_for(the model's max_model_len)
    max_prompt_tokens: int | None = None  # None: the model's max_model_len
    max_in_flight_per_client: int = 1024
    max_in_flight_total: int = 4096
    max_abort_ids: int = 4096
    max_queued_requests: int = 4096  # samples beyond the engine's max_num_seqs
    max_request_rate_per_client: float = 0.0  # Generates per second; 0: unlimited
    request_rate_burst: int = 256
    client_send_hwm: int = 10_000  # frames queued to one client before it is a slow consumer
    max_clients: int = 4096  # sessions at once (and slow consumers still owed frames)
    max_stop_sequences: int = 32  # SamplingParams.stop_token_sequences per request
    max_stop_sequence_len: int = 64  # tokens in one stop sequence
    max_bad_words: int = 1024  # SamplingParams.bad_words_token_ids per request
    max_bad_word_len: int = 64  # tokens in one bad word
    # Multimodal items (models with modalities only; PROTOCOL.md §7.16).
    max_multimodal_items: int = 16  # per request
    max_multimodal_item_bytes: int = 32 * 1024 * 1024
    max_multimodal_request_bytes: int = 64 * 1024 * 1024
    multimodal_cache_bytes: int = 1024 * 1024 * 1024  # items held for resending by hash
    # Tensor bytes (as the engine holds them) of accepted requests not yet finished.
    max_multimodal_bytes_in_flight_per_client: int = 1024 * 1024 * 1024
    max_multimodal_bytes_in_flight: int = 4 * 1024 * 1024 * 1024
    default_heartbeat_interval_s: float = 5.0
    min_heartbeat_interval_s: float = 0.05
    max_heartbeat_interval_s: float = 300.0
    heartbeat_timeout_factor: float = 3.0

    def for_model(self, max_model_len: int, multimodal: bool = False) -> GatewayLimits:
        """These limits with every default that follows the model filled in (a multimodal
        model's frames hold a request's tensors too)."""
        if self.max_frame_bytes is not None:
            return self
        frame = frame_limit_for(max_model_len)
        if multimodal:
            frame += self.max_multimodal_request_bytes + 64 * self.max_multimodal_items * 1024
        return replace(self, max_frame_bytes=frame)


def model_info(info: EngineInfo) -> ModelInfo:
    """What HelloAck says of the served model."""
    return ModelInfo(
        name=info.model_name,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        cpu_attention=info.cpu_attention,
        modalities=list(info.modalities),
        multimodal=dict(info.multimodal),
    )


def wire_limits(limits: GatewayLimits, info: EngineInfo, multimodal: bool) -> Limits:
    """The limits as enforced for this model (HelloAck.limits); the multimodal ones are 0
    for a model that takes no items."""
    mm = multimodal
    max_prompt = limits.max_prompt_tokens or info.max_model_len
    return Limits(
        max_prompt_tokens=min(max_prompt, info.max_model_len),
        max_in_flight_per_client=limits.max_in_flight_per_client,
        max_in_flight_total=limits.max_in_flight_total,
        max_frame_bytes=limits.max_frame_bytes,
        max_abort_ids=limits.max_abort_ids,
        max_logprobs=info.max_logprobs,
        max_queued_requests=limits.max_queued_requests,
        max_request_rate_per_client=limits.max_request_rate_per_client,
        client_send_hwm=limits.client_send_hwm,
        max_clients=limits.max_clients,
        max_stop_sequences=limits.max_stop_sequences,
        max_stop_sequence_len=limits.max_stop_sequence_len,
        max_bad_words=limits.max_bad_words,
        max_bad_word_len=limits.max_bad_word_len,
        max_multimodal_items=limits.max_multimodal_items if mm else 0,
        max_multimodal_item_bytes=limits.max_multimodal_item_bytes if mm else 0,
        max_multimodal_request_bytes=limits.max_multimodal_request_bytes if mm else 0,
        multimodal_cache_bytes=limits.multimodal_cache_bytes if mm else 0,
        max_multimodal_bytes_in_flight_per_client=(
            limits.max_multimodal_bytes_in_flight_per_client if mm else 0
        ),
        max_multimodal_bytes_in_flight=limits.max_multimodal_bytes_in_flight if mm else 0,
    )
