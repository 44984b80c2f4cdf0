"""Text on top of a client: requests whose outputs carry text, with stop strings ended
in the engine as soon as they match (AsyncClient, GatewayPool and the blocking Client)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from codec import Finished, FinishReason, Logprobs, RequestOptions, SamplingParams

from .sample import SampleText, TextOutput
from .stop_strings import TextParams
from .tokenizer import TextError, TextTokenizer, load_tokenizer

__all__ = ["AsyncTextClient", "TextClient", "TextCompletion", "TextStream"]


@dataclass(slots=True)
class TextCompletion:
    """A whole sample with its text. ``finished``: the gateway's terminal (counts,
    timings), None when the client ended the sample on a stop string."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stop_reason: int | list[int] | str | None
    logprobs: Logprobs | None = None
    finished: Finished | None = None
    prompt_logprobs: Logprobs | None = None

    @classmethod
    def of(cls, out: TextOutput) -> TextCompletion:
        assert out.finish_reason is not None
        return cls(
            out.request_id,
            out.index,
            out.text,
            out.token_ids,
            out.finish_reason,
            out.stop_reason,
            out.logprobs,
            out.finished,
            out.prompt_logprobs,
        )


def _as_tokenizer(tokenizer: TextTokenizer | str | Path) -> TextTokenizer:
    return tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)


def _check_sampling(sampling: SamplingParams) -> None:
    if sampling.hold_back_stop_sequences is False:
        raise TextError(
            "hold_back_stop_sequences=False cannot be used with text: text given out for "
            "ids the gateway later cuts could not be taken back"
        )


class TextStream:
    """A request's TextOutputs, as an async iterator (``AsyncTextClient.generate``).

    The Generate is sent when iteration starts. A sample ended by a stop string gets its
    last output at once, and the gateway is told to stop it in the engine (the request,
    or with n > 1 only that sample: AbortSamples). ``aclose()`` aborts the request.
    """

    def __init__(
        self,
        client: Any,
        tokenizer: TextTokenizer,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        text: TextParams,
        *,
        stream: bool,
        request_id: str | None,
        options: RequestOptions | None,
    ):
        _check_sampling(sampling)
        n = sampling.n if sampling.n and sampling.n > 0 else 1
        prompt = list(prompt_token_ids)
        min_tokens = sampling.min_tokens or 0
        self._samples = [
            SampleText(tokenizer, prompt, text, min_tokens=min_tokens, delta=stream)
            for _ in range(n)
        ]
        self._stream = stream
        # Stop strings are checked on every step's tokens, so those requests always stream.
        self._requests = client.generate(
            prompt,
            sampling,
            stream=stream or bool(text.stop),
            request_id=request_id,
            options=options,
        )
        self.request_id: str = self._requests.request_id
        self._left = n

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> TextOutput:
        while self._left:
            out = await self._requests.__anext__()
            sample = self._samples[out.index]
            if sample.done:
                continue  # a sample a stop string ended, still running in the engine
            try:
                result = sample.add(out)
            except TextError as exc:  # the engine would generate on for nobody: abort it
                await self.aclose()
                raise TextError(f"request {self.request_id!r}: {exc}") from exc
            if result.done:
                self._left -= 1
                if not self._left:
                    await self._requests.aclose()  # aborts what the engine still runs
                elif result.finished is None:  # a stop string: the engine would go on
                    self._requests.abort_samples([out.index])
                return result
            if self._stream and (result.text or result.token_ids):
                return result
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop the request: abort it if it is still running."""
        self._left = 0
        await self._requests.aclose()


class AsyncTextClient:
    """Text requests through an AsyncClient or a GatewayPool, with a tokenizer (or the
    path of one): ``generate`` streams TextOutputs; ``complete`` gives TextCompletions."""

    def __init__(self, client: Any, tokenizer: TextTokenizer | str | Path):
        self.client = client
        self.tokenizer = _as_tokenizer(tokenizer)

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        text: TextParams | None = None,
        *,
        stream: bool = True,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> TextStream:
        """Stream the request's text: ``async for out in ...`` (TextOutputs, by sample)."""
        return TextStream(
            self.client,
            self.tokenizer,
            prompt_token_ids,
            sampling or SamplingParams(),
            text or TextParams(),
            stream=stream,
            request_id=request_id,
            options=options,
        )

    async def complete_samples(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        text: TextParams | None = None,
        *,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> list[TextCompletion]:
        """One TextCompletion per sample, by index."""
        done = {}
        async for out in self.generate(
            prompt_token_ids,
            sampling,
            text,
            stream=False,
            request_id=request_id,
            options=options,
        ):
            done[out.index] = TextCompletion.of(out)
        return [done[i] for i in sorted(done)]

    async def complete(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        text: TextParams | None = None,
        **kwargs: Any,
    ) -> TextCompletion:
        """A single-sample request's TextCompletion."""
        if sampling is not None and sampling.n not in (None, 1):
            raise ValueError("complete() is for n=1; use complete_samples() for n>1")
        (completion,) = await self.complete_samples(prompt_token_ids, sampling, text, **kwargs)
        return completion


class TextClient:
    """The blocking Client's text requests (as AsyncTextClient)."""

    def __init__(self, client: Any, tokenizer: TextTokenizer | str | Path):
        self.client = client
        self._async = AsyncTextClient(client._async, tokenizer)
        self.tokenizer = self._async.tokenizer

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        text: TextParams | None = None,
        **kwargs: Any,
    ) -> Iterator[TextOutput]:
        """Like AsyncTextClient.generate, as a plain iterator."""
        run = self.client._run
        outputs = self._async.generate(prompt_token_ids, sampling, text, **kwargs)
        try:
            while True:
                try:
                    yield run(outputs.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self.client._loop.is_running():
                run(outputs.aclose())

    def complete_samples(self, *args: Any, **kwargs: Any) -> list[TextCompletion]:
        return self.client._run(self._async.complete_samples(*args, **kwargs))

    def complete(self, *args: Any, **kwargs: Any) -> TextCompletion:
        return self.client._run(self._async.complete(*args, **kwargs))
