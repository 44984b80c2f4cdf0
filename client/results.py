"""Completion: a whole sample, accumulated from a request's RequestOutputs."""

from __future__ import annotations

from collections.abc import AsyncIterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from codec import (
    Finished,
    FinishReason,
    Logprobs,
    RequestOptions,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    WeightVersionSpan,
)

__all__ = ["Completion", "Accumulator", "CompletionCalls", "completions_of"]


@dataclass(slots=True)
class Completion:
    """Everything one sample produced, with its terminal information."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: FinishReason
    stop_reason: int | list[int] | None  # a stop token id, or the matched stop sequence
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    external_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    timings: RequestTimings | None = None
    weight_versions: list[WeightVersionSpan] | None = None  # which weights made which tokens


@dataclass(slots=True)
class Accumulator:
    """Folds a request's RequestOutputs into one Completion per sample."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, Logprobs | None] = field(default_factory=dict)
    prompt_logprobs: dict[int, Logprobs | None] = field(default_factory=dict)
    done: dict[int, Completion] = field(default_factory=dict)

    def add(self, out: RequestOutput) -> Completion | None:
        """Fold one output in; returns the sample's Completion when it finished."""
        i = out.index
        self.token_ids.setdefault(i, []).extend(out.new_token_ids)
        self.logprobs[i] = Logprobs.concat(self.logprobs.get(i), out.logprobs)
        self.prompt_logprobs[i] = Logprobs.concat(self.prompt_logprobs.get(i), out.prompt_logprobs)
        fin: Finished | None = out.finished
        if fin is None:
            return None
        tokens = self.token_ids[i]
        if isinstance(fin.stop_reason, list) and len(tokens) > fin.output_tokens:
            # A stop sequence matched in tokens streamed at once (hold_back_stop_sequences
            # false): the gateway's cut is output_tokens.
            del tokens[fin.output_tokens :]
            self.logprobs[i] = Logprobs.rows(self.logprobs[i], 0, fin.output_tokens)
        completion = Completion(
            request_id=out.request_id,
            index=i,
            token_ids=tokens,
            finish_reason=fin.finish_reason,
            stop_reason=fin.stop_reason,
            prompt_tokens=fin.prompt_tokens,
            output_tokens=fin.output_tokens,
            cached_tokens=fin.cached_tokens,
            logprobs=self.logprobs[i],
            prompt_logprobs=self.prompt_logprobs[i],
            external_cached_tokens=fin.external_cached_tokens,
            kv_transfer_params=fin.kv_transfer_params,
            timings=fin.timings,
            weight_versions=fin.weight_versions,
        )
        self.done[i] = completion
        return completion


async def completions_of(outputs: AsyncIterable[RequestOutput]) -> list[Completion]:
    """A request's outputs (its stream, to its end) folded into one Completion per sample,
    by index."""
    acc = Accumulator()
    try:
        async for out in outputs:
            acc.add(out)
    finally:  # cancelled or failed midway: a stream still live is aborted when closed
        close = getattr(outputs, "aclose", None)
        if close is not None:
            await close()
    return [acc.done[i] for i in sorted(acc.done)]


class CompletionCalls:
    """``complete()`` and ``complete_samples()`` over a class's streaming ``generate()``
    (AsyncClient, GatewayPool)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    async def complete_samples(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> list[Completion]:
        """Run a non-streaming request; one Completion per sample, by index."""
        return await completions_of(
            self.generate(
                prompt_token_ids, sampling, stream=False, request_id=request_id, options=options
            )
        )

    async def complete(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> Completion:
        """Run a non-streaming single-sample request and return its Completion."""
        if sampling is not None and sampling.n not in (None, 1):
            raise ValueError("complete() is for n=1; use complete_samples() for n>1")
        (completion,) = await self.complete_samples(
            prompt_token_ids, sampling, request_id=request_id, options=options
        )
        return completion
