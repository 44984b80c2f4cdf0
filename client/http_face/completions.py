"""``/v1/completions`` for TRL's VLLMClient and other completions clients: a prompt or a
batch, n samples per prompt, choices prompt-major. Prompts are token ids; with a tokenizer
(``--tokenizer``) also text, and the answers carry text with vLLM's stop strings applied,
through ``client.text``. Logprob tokens are ``token_id:N`` without a tokenizer (or with
``return_tokens_as_token_ids``), else the token's text."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from codec import FinishReason, Logprobs, SamplingParams

from .bodies import HttpError, options_from, parse_completion, sampling_from
from .replies import Ended, error_of, json_answer, sse
from .responses import completion_choice, completion_logprobs, final_usage, usage


@dataclass(slots=True)
class Piece:
    """What one output adds to one sample (of one prompt)."""

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | list[int] | str | None = None
    prompt_tokens: int | None = None  # on a sample's last piece, when the gateway said


@dataclass(slots=True)
class Sample:
    """A whole sample, folded from its pieces (a non-streamed answer)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Logprobs | None = None
    end: Ended | None = None


# vLLM's text-side fields, applied by client.text when the face has a tokenizer.
_TEXT_FIELDS = (
    "stop",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


class CompletionRoutes:
    """The completions route of HttpFace (a mixin: it reads the face's pool and state)."""

    pool: Any
    model_name: str
    fingerprint: str
    tokenizer: Any

    def check_data_access(self, request: web.Request) -> None:  # pragma: no cover
        raise NotImplementedError

    def lora_for(self, model: str | None) -> str | None:  # pragma: no cover
        raise NotImplementedError

    def track(self, answer_id: str, pool_id: str) -> None:  # pragma: no cover
        raise NotImplementedError

    def untrack(self, answer_id: str, pool_id: str) -> None:  # pragma: no cover
        raise NotImplementedError

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.check_data_access(request)
        body, prompts, fields = parse_completion(
            await request.read(), text_prompts=self.tokenizer is not None
        )
        lora = self.lora_for(body.model)
        text = self._text_params(fields)
        sampling = sampling_from(fields)
        if self.tokenizer is not None:
            add_special = fields.get("add_special_tokens", True) is not False
            prompts = [self._ids(p, add_special) for p in prompts]
        base = body.request_id or request.headers.get("X-Request-Id") or os.urandom(8).hex()
        answer_id = f"cmpl-{base}"
        options = options_from(body, lora, request.headers.get("X-Session-ID"))
        streams = [self._generate(p, sampling, text, bool(body.stream), options) for p in prompts]
        for stream in streams:
            self.track(answer_id, stream.request_id)
        head = {
            "id": answer_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or self.model_name,
        }
        as_ids = self.tokenizer is None or bool(body.return_tokens_as_token_ids)
        answer = _Answer(head, prompts, sampling.n or 1, body, self.tokenizer, as_ids)
        try:
            if body.stream:
                return await answer.streamed(request, streams)
            return await answer.whole(streams, self.fingerprint)
        finally:
            for stream in streams:
                self.untrack(answer_id, stream.request_id)
                await stream.aclose()

    def _text_params(self, fields: dict[str, Any]) -> Any:
        """The text-side fields (stop strings, special tokens) as client.text's TextParams,
        taken out of ``fields``; None without a tokenizer (sampling_from refuses them)."""
        if self.tokenizer is None:
            return None
        from client.text import TextError, TextParams

        given = {k: fields.pop(k) for k in _TEXT_FIELDS if k in fields}
        stop = given.get("stop") or None
        try:
            return TextParams(
                stop=stop,
                include_stop_str_in_output=bool(given.get("include_stop_str_in_output", False)),
                skip_special_tokens=given.get("skip_special_tokens", True) is not False,
                spaces_between_special_tokens=given.get("spaces_between_special_tokens", True)
                is not False,
            )
        except TextError as exc:
            raise HttpError(400, str(exc), param="stop") from None

    def _ids(self, prompt: list[int] | str, add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        ids = self.tokenizer.hf.encode(prompt, add_special_tokens=add_special_tokens)
        if not ids:
            raise HttpError(400, "Prompt cannot be empty", param="prompt")
        return ids

    def _generate(
        self, prompt: list[int], sampling: SamplingParams, text: Any, stream: bool, options: Any
    ) -> Any:
        """The sample pieces of one prompt: through client.text with a tokenizer (text,
        stop strings), else the pool's outputs as they are."""
        if self.tokenizer is None:
            return _TokenPieces(
                self.pool.generate(prompt, sampling, stream=stream, options=options)
            )
        from client.text import AsyncTextClient

        texts = AsyncTextClient(self.pool, self.tokenizer)
        return _TextPieces(texts.generate(prompt, sampling, text, stream=stream, options=options))


class _TokenPieces:
    """A pool's request as Pieces."""

    def __init__(self, stream: Any):
        self.stream = stream
        self.request_id = stream.request_id

    async def __aiter__(self) -> AsyncIterator[Piece]:
        async for out in self.stream:
            fin = out.finished
            yield Piece(
                out.index,
                out.new_token_ids,
                logprobs=out.logprobs,
                finish_reason=fin.finish_reason if fin else None,
                stop_reason=fin.stop_reason if fin else None,
                prompt_tokens=fin.prompt_tokens if fin else None,
            )

    async def aclose(self) -> None:
        await self.stream.aclose()


class _TextPieces(_TokenPieces):
    """A client.text request as Pieces (text with the stop strings applied)."""

    async def __aiter__(self) -> AsyncIterator[Piece]:
        async for out in self.stream:
            fin = out.finished
            yield Piece(
                out.index,
                out.token_ids,
                out.text,
                out.logprobs,
                out.finish_reason,
                out.stop_reason,
                fin.prompt_tokens if fin else None,
            )


class _Answer:
    """One completions answer over the pieces of every prompt."""

    def __init__(
        self,
        head: dict[str, Any],
        prompts: list[list[int]],
        n: int,
        body: Any,
        tokenizer: Any,
        as_ids: bool,
    ):
        self.head, self.prompts, self.n, self.body = head, prompts, n, body
        self.tokenizer, self.as_ids = tokenizer, as_ids
        self.ids = bool(body.return_token_ids)

    def logprobs(self, rows: Logprobs | None) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        rows = rows or Logprobs([], [], [])
        decode = None if self.as_ids else (lambda t: self.tokenizer.decode([t]))
        return completion_logprobs(rows, self.body.logprobs, decode)

    async def whole(self, streams: list[Any], fingerprint: str) -> web.Response:
        async def collect(stream: Any) -> tuple[dict[int, Sample], int | None]:
            samples: dict[int, Sample] = {}
            prompt_tokens = None
            async for piece in stream:
                sample = samples.setdefault(piece.index, Sample())
                sample.token_ids += piece.token_ids
                sample.text += piece.text
                sample.logprobs = Logprobs.concat(sample.logprobs, piece.logprobs)
                if piece.finish_reason is not None:
                    sample.end = Ended(piece.finish_reason, piece.stop_reason)
                    prompt_tokens = piece.prompt_tokens or prompt_tokens
            return samples, prompt_tokens

        results = await asyncio.gather(*(collect(s) for s in streams))
        choices, prompt_total, generated = [], 0, 0
        for p, (prompt, (samples, prompt_tokens)) in enumerate(
            zip(self.prompts, results, strict=True)
        ):
            prompt_total += prompt_tokens or len(prompt)
            for index in sorted(samples):
                sample = samples[index]
                choice = completion_choice(
                    p * self.n + index,
                    sample.token_ids if self.ids else None,
                    self.logprobs(sample.logprobs),
                    sample.end,
                    prompt if self.ids else None,
                    streamed=False,
                    text=sample.text,
                )
                choices.append(choice)
                generated += len(sample.token_ids)
        return json_answer(
            {
                **self.head,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": fingerprint,
                "usage": usage(prompt_total, generated),
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    async def streamed(self, request: web.Request, streams: list[Any]) -> web.StreamResponse:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(p: int, stream: Any) -> None:
            try:
                async for piece in stream:
                    queue.put_nowait((p, piece))
                queue.put_nowait((p, None))
            except BaseException as exc:  # a refusal or a lost session: answered below
                queue.put_nowait((p, exc))

        pumps = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]
        try:
            first = await queue.get()
            if isinstance(first[1], BaseException):
                raise first[1]
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await self._chunks(response, queue, first)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for task in pumps:
                task.cancel()

    async def _chunks(self, response: Any, queue: asyncio.Queue, item: tuple[int, Any]) -> None:
        prompt_sent: set[int] = set()  # choices whose first chunk went (it names the prompt)
        generated, prompt_total, open_prompts = 0, 0, len(self.prompts)
        while True:
            p, piece = item
            if isinstance(piece, BaseException):
                await response.write(sse(error_of(piece).body()))
                return
            if piece is None:
                open_prompts -= 1
                if not open_prompts:
                    break
            else:
                generated += len(piece.token_ids)
                if piece.finish_reason is not None and piece.index == 0:
                    prompt_total += piece.prompt_tokens or len(self.prompts[p])
                index = p * self.n + piece.index
                prompt_ids = self.prompts[p] if self.ids and index not in prompt_sent else None
                prompt_sent.add(index)
                end = None
                if piece.finish_reason is not None:
                    end = Ended(piece.finish_reason, piece.stop_reason)
                choice = completion_choice(
                    index,
                    piece.token_ids if self.ids else None,
                    self.logprobs(piece.logprobs),
                    end,
                    prompt_ids,
                    streamed=True,
                    text=piece.text,
                )
                await response.write(sse({**self.head, "choices": [choice]}))
            item = await queue.get()
        options = self.body.stream_options
        if options is not None and options.include_usage:
            final = final_usage(prompt_total, generated)
            await response.write(sse({**self.head, "choices": [], "usage": final}))
