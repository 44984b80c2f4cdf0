"""What vLLM's outputs and configs become for the gateway: wire logprobs, converted step
outputs, and the EOS ids a request stops on. No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from codec import Logprobs

from ..engine import PrefillStatsLike


def stopping_eos_token_ids(
    generation_config: dict[str, Any], tokenizer_eos_token_id: int | None
) -> list[int]:
    """The EOS ids vLLM's InputProcessor makes a request stop on, in order: the
    tokenizer's (when one is loaded), then every ``eos_token_id`` of the generation
    config vLLM read (``generation_config.json``; without that file, ``config.json``'s).
    A ``generation_config.json`` that names none leaves only the tokenizer's."""
    first = token_id_list(tokenizer_eos_token_id)
    return list(dict.fromkeys(first + token_id_list(generation_config.get("eos_token_id"))))


def token_id_list(value: int | Iterable[int] | None) -> list[int]:
    """A config's token-id field (one id, several, or none) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


@dataclass(slots=True)
class ConvertedOutput:
    """An EngineCoreOutput whose logprobs were converted to wire Logprobs."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: int | None
    stop_reason: int | str | None
    new_logprobs: Logprobs | None
    new_prompt_logprobs_tensors: Logprobs | None
    prefill_stats: PrefillStatsLike | None
    kv_transfer_params: dict[str, Any] | None
    events: list[Any] | None


def to_wire_logprobs(token_ids: Any, logprobs: Any, ranks: Any) -> Logprobs:
    return Logprobs(token_ids=token_ids.tolist(), logprobs=logprobs.tolist(), ranks=ranks.tolist())
