"""Text on the face's data routes (``--tokenizer``): text prompts encoded off the event
loop within what ``max_model_len`` allows, and vLLM's text-side fields as TextParams."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from .bodies import HttpError

__all__ = ["TextPrompts", "text_params_from", "TEXT_FIELDS"]

# vLLM's text-side fields, applied by client.text when the face has a tokenizer.
TEXT_FIELDS = (
    "stop",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def text_params_from(fields: dict[str, Any]) -> Any:
    """The text-side fields of a body as client.text's TextParams, taken out of
    ``fields``; HttpError 400 for what client.text refuses."""
    from client.text import TextError, TextParams

    given = {k: fields.pop(k) for k in TEXT_FIELDS if k in fields}
    stop = given.get("stop") or None
    if isinstance(stop, str):
        stop = [stop]
    try:
        return TextParams(
            stop=stop,
            include_stop_str_in_output=bool(given.get("include_stop_str_in_output", False)),
            skip_special_tokens=given.get("skip_special_tokens", True) is not False,
            spaces_between_special_tokens=given.get("spaces_between_special_tokens", True)
            is not False,
        )
    except (TextError, TypeError, ValueError) as exc:
        raise HttpError(400, str(exc), param="stop") from None


class TextPrompts:
    """Encodes text prompts for a model of ``max_model_len`` tokens: a prompt longer than
    ``max_model_len`` tokens could ever span (the vocabulary's longest token, in
    characters, per token) is refused before any encoding; the others are encoded on one
    worker thread, so the event loop (every other caller's streams, /health) runs on
    meanwhile and prompts are encoded one at a time."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * _longest_token_chars(tokenizer)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, "face-tokenizer")

    def check(self, prompt: str) -> None:
        """HttpError 400 for a text no ``max_model_len`` prompt can be."""
        if len(prompt) > self.max_chars:
            raise HttpError(
                400,
                f"the text prompt has {len(prompt)} characters, more than {self.max_model_len}"
                f" tokens of this tokenizer can spell ({self.max_chars}): it cannot fit the"
                " model's max_model_len",
                param="prompt",
            )

    async def encode(self, prompt: str, add_special_tokens: bool) -> list[int]:
        self.check(prompt)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._worker,
            lambda: self.tokenizer.hf.encode(prompt, add_special_tokens=add_special_tokens),
        )
        if not ids:
            raise HttpError(400, "Prompt cannot be empty", param="prompt")
        return list(ids)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token's text can have: its vocabulary's longest entry
    (byte-level entries spell one character per byte, at least as many as the text's)."""
    vocabulary = tokenizer.hf.get_vocab()
    return max((len(piece) for piece in vocabulary), default=1) or 1
