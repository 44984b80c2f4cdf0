"""``/inference/v1/generate``'s answer over one request's pieces: whole
(``GenerateTokensResponse``) or streamed as vLLM's SSE chunks; ``output_mode: "text"``
(with a tokenizer) adds each choice's text and the chat-shaped logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from client.errors import ClientError

from .pieces import Piece, Sample
from .replies import Ended, error_of, sse
from .responses import TokenText, final_usage, generate_body, generate_choice, usage

__all__ = ["GenerateAnswer"]

_EVENT_STREAM = {"Content-Type": "text/event-stream"}


class GenerateAnswer:
    """One generate request's answer: ``body`` (the parsed GenerateBody), ``top`` (its
    sampling logprobs), ``decode`` (the text mode's logprob token texts: the face's
    LogprobTokenText), ``text``: the text output mode."""

    def __init__(
        self, request_id: str, body: Any, top: int | None, decode: TokenText | None, text: bool
    ):
        self.request_id = request_id
        self.body = body
        self.top = top
        self.text = text
        self.decode = decode if text else None
        self.mode = "text" if text else "tokens"
        self.sampled: dict[int, list[int]] = {}  # per sample, its ids streamed so far

    def _choice(
        self, index: int, token_ids: list[int], end: Ended | None, finished: Any, logprobs: Any,
        text: str,
    ) -> dict[str, Any]:  # fmt: skip
        before = self.sampled.setdefault(index, [])
        choice = generate_choice(
            index,
            token_ids,
            end,
            finished.weight_versions if finished is not None else None,
            logprobs,
            self.top,
            text=text if self.text else None,
            decode=self.decode,
            before=before,
        )
        before += token_ids
        return choice

    def whole(self, model: str, created: int, samples: dict[int, Sample]) -> dict[str, Any]:
        """The whole answer of a request's samples (``fold``)."""
        choices = [
            self._choice(i, s.token_ids, s.end, s.finished, s.logprobs, s.text)
            for i, s in sorted(samples.items())
        ]
        finished = [s.finished for s in samples.values() if s.finished is not None]
        prompt_tokens = finished[0].prompt_tokens if finished else len(self.body.token_ids)
        return generate_body(
            self.request_id,
            model,
            created,
            choices,
            prompt_tokens,
            prompt_token_ids=self.body.token_ids if self.body.return_token_ids else None,
            kv_transfer_params=next(
                (f.kv_transfer_params for f in finished if f.kv_transfer_params), None
            ),
            text=self.text,
        )

    async def streamed(
        self, request: web.Request, pieces: AsyncIterator[Piece]
    ) -> web.StreamResponse:
        """vLLM's SSE stream: a chunk per sample output, the usage chunk when asked for,
        ``[DONE]``. A request refused before its first output answers with its error."""
        first = await anext(pieces)
        response = web.StreamResponse(headers=_EVENT_STREAM)
        await response.prepare(request)
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        prompt_ids = self.body.token_ids if self.body.return_token_ids else None
        generated: dict[int, int] = {}
        prompt_tokens = len(self.body.token_ids)
        piece: Piece = first
        try:
            while True:
                generated[piece.index] = generated.get(piece.index, 0) + len(piece.token_ids)
                if piece.prompt_tokens is not None:
                    prompt_tokens = piece.prompt_tokens
                end = None
                if piece.finish_reason is not None:
                    end = Ended(piece.finish_reason, piece.stop_reason)
                running = usage(prompt_tokens, generated[piece.index]) if continuous else None
                chunk: dict[str, Any] = {"request_id": self.request_id, "usage": running}
                if prompt_ids is not None:
                    chunk["prompt_token_ids"] = prompt_ids
                    chunk["mm_placeholders"] = None
                    prompt_ids = None
                chunk["output_mode"] = self.mode
                chunk["choices"] = [
                    self._choice(
                        piece.index, piece.token_ids, end, piece.finished, piece.logprobs,
                        piece.text,
                    )
                ]  # fmt: skip
                await response.write(sse(chunk))
                try:
                    piece = await anext(pieces)
                except StopAsyncIteration:
                    break
            if include_usage:
                last = {"request_id": self.request_id, "usage": None, "output_mode": self.mode}
                last["usage"] = final_usage(prompt_tokens, sum(generated.values()))
                last["choices"] = []
                await response.write(sse(last))
        except ClientError as exc:  # mid-stream: vLLM sends the error as a data line
            await response.write(sse(error_of(exc).body()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
