"""A face request's outputs as ``Piece``s, one shape for the token and the text paths, and
``Sample``s folded from them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from codec import Finished, FinishReason, Logprobs

from .replies import Ended

__all__ = ["Piece", "Sample", "pieces_of", "fold"]


@dataclass(slots=True)
class Piece:
    """What one output adds to one sample (of one prompt)."""

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | list[int] | str | None = None
    finished: Finished | None = None  # the gateway's terminal (None: ended by a stop string)

    @property
    def prompt_tokens(self) -> int | None:
        return self.finished.prompt_tokens if self.finished is not None else None


@dataclass(slots=True)
class Sample:
    """A whole sample, folded from its pieces (a non-streamed answer)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: Logprobs | None = None
    end: Ended | None = None
    finished: Finished | None = None


async def pieces_of(
    stream: Any, *, text: bool, eos_token_id: int | None = None
) -> AsyncIterator[Piece]:
    """``stream``'s outputs as Pieces: a pool request's RequestOutputs, or (``text``)
    client.text's TextOutputs. ``eos_token_id`` (a face with a tokenizer): a sample ended
    on it has no stop reason, as vLLM's engine reports an EOS with a tokenizer loaded (the
    gateway's engines, without one, stop on it as a stop token id and name it)."""
    async for out in stream:
        if text:
            piece = Piece(
                out.index,
                out.token_ids,
                out.text,
                out.logprobs,
                out.finish_reason,
                out.stop_reason,
                out.finished,
            )
        else:
            fin = out.finished
            piece = Piece(
                out.index,
                out.new_token_ids,
                logprobs=out.logprobs,
                finish_reason=fin.finish_reason if fin else None,
                stop_reason=fin.stop_reason if fin else None,
                finished=fin,
            )
        if eos_token_id is not None and piece.stop_reason == eos_token_id:
            piece.stop_reason = None
        yield piece


async def fold(pieces: AsyncIterator[Piece]) -> dict[int, Sample]:
    """Every sample of a request, by index, folded from its pieces to their end."""
    samples: dict[int, Sample] = {}
    async for piece in pieces:
        sample = samples.setdefault(piece.index, Sample())
        sample.token_ids += piece.token_ids
        sample.text += piece.text
        sample.logprobs = Logprobs.concat(sample.logprobs, piece.logprobs)
        if piece.finish_reason is not None:
            sample.end = Ended(piece.finish_reason, piece.stop_reason)
            sample.finished = piece.finished
    return samples
