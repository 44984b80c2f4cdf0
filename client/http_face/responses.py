"""The gateway's outputs in vLLM 0.32's response shapes for ``/inference/v1/generate``
(``GenerateTokensResponse`` and its SSE chunks), field for field.

One addition: each logprob entry also carries ``"token": "token_id:N"``, the form vLLM's
servers sent before PR #58181 and that the ``renderers`` package (verifiers, prime-rl)
still requires; vLLM's own fields (``token_id``, ``logprob``, ``rank``) are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from client.results import Completion
from codec import FinishReason, Logprobs, WeightVersionSpan

__all__ = [
    "finish_reason_name",
    "generate_choice",
    "generate_body",
    "generate_response",
    "text_logprobs_content",
    "usage",
    "final_usage",
    "candidate_rows",
    "completion_candidates",
    "logprobs_content",
    "weight_spans",
]

_FINISH_NAMES = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
    FinishReason.REPETITION: "repetition",
    FinishReason.TIMED_OUT: "abort",  # no such reason in vLLM: the request was cut short
}
LOGPROB_FLOOR = -9999.0  # vLLM's clamp for -inf and NaN
TokenText = Callable[[int, Sequence[int]], str]  # a token's text after the sampled ids


def finish_reason_name(reason: FinishReason) -> str:
    return _FINISH_NAMES.get(reason, "abort")


def _clamp(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) else max(logprob, LOGPROB_FLOOR)


def candidate_rows(logprobs: Logprobs) -> Iterator[tuple[int, dict[int, tuple[float, int]]]]:
    """Per position, the sampled id and its candidates ``{id: (logprob, rank)}`` in the
    engine's order, as vLLM's frontend builds its dict from a row [sampled, top1, top2, ...]:
    an id met again (the sampled token among the top-k) keeps its first place and takes the
    later entry's values (its top-k rank)."""
    for row_ids, row_logprobs, sampled_rank in zip(
        logprobs.token_ids, logprobs.logprobs, logprobs.ranks, strict=True
    ):
        candidates: dict[int, tuple[float, int]] = {}
        for j, (token_id, logprob) in enumerate(zip(row_ids, row_logprobs, strict=True)):
            candidates[token_id] = (logprob, sampled_rank if j == 0 else j)
        yield row_ids[0], candidates


def logprobs_content(logprobs: Logprobs, top: int) -> list[dict[str, Any]]:
    """vLLM's ``GenerateLogProbs.content`` for ``logprobs=top`` (-1: every candidate): per
    token the sampled entry, and its candidates in the engine's order (the sampled token
    first, each id once) cut to ``max(top, 1)``."""
    content = []
    keep = None if top == -1 else max(top, 1)
    for sampled, candidates in candidate_rows(logprobs):
        logprob, rank = candidates[sampled]
        entries = list(candidates.items())[:keep]
        content.append(
            {
                "token_id": sampled,
                "logprob": _clamp(logprob),
                "rank": rank or None,
                "top_logprobs": [
                    {
                        "token_id": t,
                        "logprob": _clamp(lp),
                        "rank": r or None,
                        "token": f"token_id:{t}",
                    }
                    for t, (lp, r) in entries
                ],
                "token": f"token_id:{sampled}",
            }
        )
    return content


def weight_spans(spans: list[WeightVersionSpan] | None) -> list[dict[str, Any]] | None:
    """vLLM's ``WeightVersionSpan``s: ``{version, start, end}`` over output-token indexes."""
    if spans is None:
        return None
    return [
        {"version": s.version, "start": s.first_token, "end": s.first_token + s.num_tokens}
        for s in spans
    ]


def final_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The usage of a stream's last chunk: vLLM sends it without its null fields."""
    return {k: v for k, v in usage(prompt_tokens, completion_tokens).items() if v is not None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def generate_choice(
    index: int,
    token_ids: list[int],
    end: Any,
    weight_versions: list[WeightVersionSpan] | None,
    rows: Logprobs | None,
    top: int | None,
    *,
    text: str | None = None,
    decode: TokenText | None = None,
    before: Sequence[int] = (),
) -> dict[str, Any]:
    """One choice of ``/inference/v1/generate`` (``end``: how the sample ended, or None in
    a stream's chunk before its end): ``GenerateTokensChoice``, or with ``text`` (the
    ``text`` output mode) ``GenerateTextChoice`` with the logprobs in the chat shape
    (tokens by ``decode``)."""
    logprobs = None
    if top is not None:
        rows = rows or Logprobs([], [], [])
        if text is None:
            logprobs = {"content": logprobs_content(rows, top)}
        else:
            content = text_logprobs_content(rows, top, decode or _placeholder, before)
            logprobs = {"content": content}
    choice: dict[str, Any] = {
        "index": index,
        "finish_reason": finish_reason_name(end.finish_reason) if end else None,
        "stop_reason": _stop_reason(end.stop_reason) if end else None,
        "token_ids": token_ids,
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": weight_spans(weight_versions),
        "logprobs": logprobs,
    }
    if text is not None:
        choice["text"] = text
    return choice


def generate_body(
    request_id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    *,
    prompt_token_ids: list[int] | None,
    kv_transfer_params: dict[str, Any] | None,
    text: bool = False,
) -> dict[str, Any]:
    """A whole ``GenerateTokensResponse`` (``GenerateTextResponse`` with ``text``)."""
    generated = sum(len(c["token_ids"]) for c in choices)
    return {
        "request_id": request_id,
        "model": model,
        "created": created,
        "usage": usage(prompt_tokens, generated),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "output_mode": "text" if text else "tokens",
        "choices": choices,
    }


def generate_response(
    request_id: str,
    model: str,
    created: int,
    completions: list[Completion],
    prompt_token_ids: list[int],
    *,
    top_logprobs: int | None,
    return_token_ids: bool,
) -> dict[str, Any]:
    """A whole ``GenerateTokensResponse`` of a request's Completions: a choice per sample."""
    choices = [
        generate_choice(c.index, c.token_ids, c, c.weight_versions, c.logprobs, top_logprobs)
        for c in completions
    ]
    return generate_body(
        request_id,
        model,
        created,
        choices,
        completions[0].prompt_tokens if completions else len(prompt_token_ids),
        prompt_token_ids=prompt_token_ids if return_token_ids else None,
        kv_transfer_params=next(
            (c.kv_transfer_params for c in completions if c.kv_transfer_params), None
        ),
    )


def _placeholder(token_id: int, context: Sequence[int] = ()) -> str:
    return f"token_id:{token_id}"


def text_logprobs_content(
    logprobs: Logprobs, top: int, decode: TokenText, before: Sequence[int] = ()
) -> list[dict[str, Any]]:
    """The ``text`` output mode's logprobs (OpenAI's chat shape, as vLLM builds them): per
    token its text, logprob and UTF-8 bytes, and its candidates in the engine's order cut
    to ``max(top, 1)`` (-1: every one). ``decode(token_id, context)`` gives a token's text
    after the sample's preceding sampled ids (``before``, then each row's)."""
    keep = None if top == -1 else max(top, 1)
    content = []
    context = list(before)
    for sampled, candidates in candidate_rows(logprobs):
        token = decode(sampled, context)
        content.append(
            {
                "token": token,
                "logprob": _clamp(candidates[sampled][0]),
                "bytes": list(token.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {
                        "token": (text := decode(t, context)),
                        "logprob": _clamp(lp),
                        "bytes": list(text.encode("utf-8", errors="replace")),
                    }
                    for t, (lp, _) in list(candidates.items())[:keep]
                ],
            }
        )
        context.append(sampled)
    return content


def _stop_reason(reason: int | list[int] | str | None) -> int | str | None:
    """vLLM's stop_reason: the stop token id or stop string; a gateway stop sequence (a
    list) has no counterpart there (the face never asks for one): its last id."""
    if isinstance(reason, list):
        return reason[-1] if reason else None
    return reason


def completion_logprobs(
    logprobs: Logprobs, top: int, decode: TokenText | None = None, before: Sequence[int] = ()
) -> dict[str, Any]:
    """The OpenAI completions ``logprobs`` object as vLLM's server makes it: tokens are
    ``token_id:N`` (``return_tokens_as_token_ids``, or no tokenizer), else
    ``decode(id, context)`` after the sample's preceding sampled ids; each position's
    ``top_logprobs`` holds the sampled token and ``top`` more (-1: every candidate)."""
    name = decode or _placeholder
    tokens, token_logprobs, tops, offsets = [], [], [], []
    last_len = 0
    context = list(before)
    for sampled, candidates in candidate_rows(logprobs):
        token = name(sampled, context)
        tokens.append(token)
        token_logprobs.append(max(candidates[sampled][0], LOGPROB_FLOOR))
        tops.append(
            {
                name(t, context): max(lp, LOGPROB_FLOOR)
                for t, (lp, _) in completion_candidates(candidates, top)
            }
        )
        offsets.append(offsets[-1] + last_len if offsets else 0)
        last_len = len(token)
        context.append(sampled)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def completion_candidates(
    candidates: dict[int, tuple[float, int]], top: int
) -> list[tuple[int, tuple[float, int]]]:
    """The completions API's share of a position's candidates: the sampled token and ``top``
    more (-1: every one)."""
    entries = list(candidates.items())
    return entries if top == -1 else entries[: top + 1]


def completion_choice(
    index: int,
    token_ids: list[int],
    logprobs: dict[str, Any] | None,
    finished: Any,
    prompt_token_ids: list[int] | None,
    *,
    streamed: bool,
    text: str = "",
) -> dict[str, Any]:
    """One choice of a completions answer (``finished``: how the sample ended, or None
    on a stream's chunk before its end; ``text``: its text, "" without a tokenizer)."""
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason_name(finished.finish_reason) if finished else None,
        "stop_reason": _stop_reason(finished.stop_reason) if finished else None,
    }
    if streamed:
        choice["prompt_token_ids"] = prompt_token_ids
        choice["token_ids"] = token_ids
    else:
        choice["token_ids"] = token_ids
        choice["prompt_logprobs"] = None
        choice["prompt_token_ids"] = prompt_token_ids
        choice["routed_experts"] = None
    return choice
