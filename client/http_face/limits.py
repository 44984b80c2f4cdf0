"""The face's own bounds on what one HTTP request may ask: ``FaceLimits``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .bodies import HttpError

__all__ = ["FaceLimits", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 64 << 20  # no body is read past this, whatever the model
_ID_BYTES = 12  # a token id in JSON: up to 10 digits and ", "
_OVERHEAD_BYTES = 1 << 20  # a body's other fields
_BIAS_BYTES = 32  # one logit_bias entry per vocabulary id, at most: '"123456": -100.0, '


@dataclass(frozen=True)
class FaceLimits:
    """Per HTTP request: ``max_prompts`` prompts in a completions body and ``max_samples``
    samples (prompts × n); per caller: ``max_in_flight_per_caller`` requests at the
    gateways (0: half the pool's budget) and ``max_queued_per_caller`` waiting for one;
    ``read_timeout_s``: how long a request's head and body may take to arrive."""

    max_prompts: int = 1024
    max_samples: int = 4096
    max_in_flight_per_caller: int = 0
    max_queued_per_caller: int = 4096
    read_timeout_s: float = 60.0

    def capacity(self, pool: Any) -> int:
        """The pool's budget for this face's session: each gateway's per-client limit."""
        known = [c.hello_ack.limits.max_in_flight_per_client for c in pool.clients if c.hello_ack]
        each = min(known) if known else 1024
        return sum(
            c.hello_ack.limits.max_in_flight_per_client if c.hello_ack else each
            for c in pool.clients
        )

    def per_caller(self, pool: Any) -> int:
        if self.max_in_flight_per_caller > 0:
            return self.max_in_flight_per_caller
        return max(1, self.capacity(pool) // 2)

    def body_bytes(self, model: Any, prompts: int, max_prompt_chars: int = 0) -> int:
        """The most bytes a body of ``prompts`` prompts of ``model`` (a ModelInfo) can
        need (each at most max_model_len ids, or ``max_prompt_chars`` characters of text,
        and a logit_bias over the vocabulary); larger ones are refused unread."""
        per_prompt = max(_ID_BYTES * model.max_model_len, 4 * max_prompt_chars)
        wanted = _OVERHEAD_BYTES + _BIAS_BYTES * model.vocab_size + prompts * per_prompt
        return min(wanted, MAX_BODY_BYTES)

    def check_samples(self, prompts: int, n: int) -> None:
        """At most ``max_samples`` samples (``prompts`` × ``n``) in one request; the count of
        prompts itself is bounded where a body's prompts are read (``parse_completion``)."""
        if prompts * n > self.max_samples:
            raise HttpError(
                400,
                f"{prompts} prompts × n = {n} is {prompts * n} samples; this face takes at most"
                f" {self.max_samples} per request (--max-samples-per-request)",
                param="n",
            )
