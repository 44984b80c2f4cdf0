"""``/v1/completions`` with token-id prompts, for TRL's VLLMClient (a batch of prompts, n
per prompt, choices prompt-major, logprob tokens as ``token_id:N``)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from aiohttp import web

from client.results import Accumulator
from codec import Logprobs

from .bodies import options_from, parse_completion, sampling_from
from .replies import ENCODE, Ended, error_of, json_answer
from .responses import completion_choice, completion_logprobs, usage


class CompletionRoutes:
    """The completions route of HttpFace (a mixin: it reads the face's pool and state)."""

    pool: Any
    live: dict[str, str]
    model_name: str
    fingerprint: str

    def check_data_access(self, request: web.Request) -> None:  # pragma: no cover
        raise NotImplementedError

    def lora_for(self, model: str | None) -> str | None:  # pragma: no cover
        raise NotImplementedError

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` with token-id prompts (one or a batch): choices prompt-major,
        ``n`` per prompt; logprob tokens as ``token_id:N`` (no tokenizer here)."""
        self.check_data_access(request)
        body, prompts, fields = parse_completion(await request.read())
        lora = self.lora_for(body.model)
        sampling = sampling_from(fields)
        n = sampling.n or 1
        base = body.request_id or request.headers.get("X-Request-Id") or os.urandom(8).hex()
        answer_id = f"cmpl-{base}"
        options = options_from(body, lora, request.headers.get("X-Session-ID"))
        streams = [
            self.pool.generate(p, sampling, stream=bool(body.stream), options=options)
            for p in prompts
        ]
        for i, stream in enumerate(streams):
            self.live[f"{answer_id}-{i}"] = stream.request_id
        head = {
            "id": answer_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or self.model_name,
        }
        try:
            if body.stream:
                return await self._completion_stream(request, body, head, prompts, streams, n)
            return await self._whole_completion(body, head, prompts, streams, n, sampling.logprobs)
        finally:
            for i, stream in enumerate(streams):
                self.live.pop(f"{answer_id}-{i}", None)
                await stream.aclose()

    async def _whole_completion(
        self,
        body: Any,
        head: dict[str, Any],
        prompts: list[list[int]],
        streams: list[Any],
        n: int,
        top: int | None,
    ) -> web.Response:
        async def collect(stream: Any) -> list[Any]:
            acc = Accumulator()
            async for out in stream:
                acc.add(out)
            return [acc.done[i] for i in sorted(acc.done)]

        results = await asyncio.gather(*(collect(s) for s in streams))
        choices, prompt_total, generated = [], 0, 0
        ids = bool(body.return_token_ids)
        for p, (prompt, completions) in enumerate(zip(prompts, results, strict=True)):
            prompt_total += completions[0].prompt_tokens if completions else len(prompt)
            for c in completions:
                logprobs = None
                if top is not None:
                    logprobs = completion_logprobs(c.logprobs or Logprobs([], [], []), top)
                fin = Ended(c.finish_reason, c.stop_reason)
                choices.append(
                    completion_choice(
                        p * n + c.index,
                        c.token_ids if ids else None,  # type: ignore[arg-type]
                        logprobs,
                        fin,
                        prompt if ids else None,
                        streamed=False,
                    )
                )
                generated += len(c.token_ids)
        return json_answer(
            {
                **head,
                "choices": choices,
                "service_tier": None,
                "system_fingerprint": self.fingerprint,
                "usage": usage(prompt_total, generated),
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            }
        )

    async def _completion_stream(
        self,
        request: web.Request,
        body: Any,
        head: dict[str, Any],
        prompts: list[list[int]],
        streams: list[Any],
        n: int,
    ) -> web.StreamResponse:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(p: int, stream: Any) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((p, out))
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
            ids = bool(body.return_token_ids)
            top = body.logprobs
            prompt_sent: set[int] = set()  # choices whose first chunk went (it names the prompt)
            generated, prompt_total, open_prompts = 0, 0, len(prompts)
            item: tuple[int, Any] = first
            while True:
                p, out = item
                if isinstance(out, BaseException):
                    error = error_of(out).body()
                    await response.write(b"data: " + ENCODE.encode(error) + b"\n\n")
                    break
                if out is None:
                    open_prompts -= 1
                    if not open_prompts:
                        break
                else:
                    generated += len(out.new_token_ids)
                    if out.finished is not None and out.index == 0:
                        prompt_total += out.finished.prompt_tokens
                    logprobs = None
                    if top is not None:
                        rows = out.logprobs or Logprobs([], [], [])
                        logprobs = completion_logprobs(rows, top)
                    index = p * n + out.index
                    prompt_ids = prompts[p] if ids and index not in prompt_sent else None
                    prompt_sent.add(index)
                    choice = completion_choice(
                        index,
                        out.new_token_ids if ids else None,  # type: ignore[arg-type]
                        logprobs,
                        out.finished,
                        prompt_ids,
                        streamed=True,
                    )
                    chunk = {**head, "choices": [choice]}
                    await response.write(b"data: " + ENCODE.encode(chunk) + b"\n\n")
                item = await queue.get()
            options = body.stream_options
            if options is not None and options.include_usage:
                final = {k: v for k, v in usage(prompt_total, generated).items() if v is not None}
                chunk = {**head, "choices": [], "usage": final}
                await response.write(b"data: " + ENCODE.encode(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for task in pumps:
                task.cancel()
