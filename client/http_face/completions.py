"""``/v1/completions`` for TRL's VLLMClient and other completions clients: a prompt or a
batch, n samples per prompt, choices prompt-major. Prompts are token ids; with a tokenizer
(``--tokenizer``) also text, and the answers carry text with vLLM's stop strings applied,
through ``client.text``. Logprob tokens are ``token_id:N`` without a tokenizer (or with
``return_tokens_as_token_ids``), else the token's text."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from client.tasks import all_or_none
from client.text.logprob_tokens import LogprobTokenText
from codec import Logprobs

from .access import routing_key
from .bodies import options_from, parse_completion, sampling_from
from .pieces import fold
from .replies import Ended, error_of, json_answer, read_body, sse
from .responses import TokenText, completion_choice, completion_logprobs, final_usage, usage
from .text import TextPrompts


class CompletionRoutes:
    """The completions route of HttpFace (a mixin: it reads the face's pool and state)."""

    pool: Any
    model: Any
    model_name: str
    fingerprint: str
    tokenizer: Any
    text: TextPrompts | None
    token_text: LogprobTokenText | None
    limits: Any

    async def completions(self, request: web.Request) -> web.StreamResponse:
        caller = self.check_data_access(request)  # type: ignore[attr-defined]
        chars = self.text.max_chars if self.text is not None else 0
        limit = self.limits.body_bytes(self.model, self.limits.max_prompts, chars)
        body, prompts, fields = parse_completion(
            await read_body(request, limit, self.limits.read_timeout_s),
            text_prompts=self.tokenizer is not None,
            max_prompts=self.limits.max_prompts,
        )
        self.check_request_rights(request, body)  # type: ignore[attr-defined]
        lora = self.lora_for(body.model)  # type: ignore[attr-defined]
        text = self.text_params(fields)  # type: ignore[attr-defined]
        sampling = sampling_from(fields)
        n = sampling.n or 1
        self.limits.check_samples(len(prompts), n)
        answer_id = self.answer_id(request, body.request_id, "cmpl-")  # type: ignore[attr-defined]
        if self.text is not None:
            add_special = fields.get("add_special_tokens", True) is not False
            for prompt in prompts:  # every text refused by its length before any is encoded
                if isinstance(prompt, str):
                    self.text.check(prompt)
            prompts = [
                p if isinstance(p, list) else await self.text.encode(p, add_special)
                for p in prompts
            ]
        options = options_from(body, lora, routing_key(caller, request))
        started = [
            self.start(  # type: ignore[attr-defined]
                caller, answer_id, p, sampling, options, stream=bool(body.stream), text=text
            )
            for p in prompts
        ]
        head = {
            "id": answer_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or self.model_name,
        }
        as_ids = self.token_text is None or bool(body.return_tokens_as_token_ids)
        answer = _Answer(head, prompts, n, body, None if as_ids else self.token_text.text)
        pieces = [p for p, _ in started]
        try:
            if body.stream:
                return await answer.streamed(request, pieces)
            return await answer.whole(pieces, self.fingerprint)
        finally:
            for _, admitted in started:
                self.untrack(caller, answer_id, admitted)  # type: ignore[attr-defined]
                await admitted.aclose()


class _Answer:
    """One completions answer over the pieces of every prompt."""

    def __init__(
        self,
        head: dict[str, Any],
        prompts: list[list[int]],
        n: int,
        body: Any,
        decode: TokenText | None,
    ):
        """``decode``: a logprob token's text (None: ``token_id:N``)."""
        self.head, self.prompts, self.n, self.body = head, prompts, n, body
        self.ids = bool(body.return_token_ids)
        self.decode = decode
        self.sampled: dict[int, list[int]] = {}  # per choice, its ids streamed so far

    def logprobs(self, choice: int, rows: Logprobs | None, ids: list[int]) -> dict[str, Any] | None:
        """A choice's logprobs for its new ``ids`` (``rows``), after the ids it had."""
        before = self.sampled.setdefault(choice, [])
        if self.body.logprobs is None:
            return None
        answer = completion_logprobs(
            rows or Logprobs([], [], []), self.body.logprobs, self.decode, before
        )
        before += ids
        return answer

    async def whole(self, streams: list[Any], fingerprint: str) -> web.Response:
        # One prompt refused: the others are cancelled (their requests aborted), none left.
        results = await all_or_none(fold(s) for s in streams)
        choices, prompt_total, generated = [], 0, 0
        for p, (prompt, samples) in enumerate(zip(self.prompts, results, strict=True)):
            told = [s.finished.prompt_tokens for s in samples.values() if s.finished]
            prompt_total += told[0] if told else len(prompt)
            for index in sorted(samples):
                sample = samples[index]
                choice = completion_choice(
                    p * self.n + index,
                    sample.token_ids if self.ids else None,
                    self.logprobs(p * self.n + index, sample.logprobs, sample.token_ids),
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
            await asyncio.gather(*pumps, return_exceptions=True)

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
                    self.logprobs(index, piece.logprobs, piece.token_ids),
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
