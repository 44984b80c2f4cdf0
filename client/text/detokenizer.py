"""Per-token text of one sample, exactly as vLLM's front-end makes it
(vllm/v1/engine/detokenizer.py, v0.32): ``tokenizers``' DecodeStream primed with the
prompt for fast tokenizers, the Python incremental algorithm for the others."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .incremental import detokenize_incrementally, prompt_window
from .tokenizer import TextTokenizer

__all__ = ["TokenDecoder", "new_token_decoder"]

logger = logging.getLogger("engine_gateway.client")

# tokenizers' error when a stream's text would shrink (a non-monotonic byte sequence);
# vLLM restarts the stream without its history (vLLM issue 17448).
_INVALID_PREFIX = "Invalid prefix encountered"


class TokenDecoder:
    """Turns one sample's token ids, one at a time, into the text each adds; primed with
    the prompt's ids (text is what follows them)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._prime(list(prompt_ids))

    def _prime(self, prompt_ids: list[int]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode_next(self, token_id: int) -> str:  # pragma: no cover - abstract
        raise NotImplementedError


class _StreamDecoder(TokenDecoder):
    """A fast tokenizer's ``DecodeStream``; with ``spaces_between_special_tokens`` off,
    consecutive added tokens are joined without the space the decoder puts between them."""

    def _prime(self, prompt_ids: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._new_stream = DecodeStream
        self._backend = self._tokenizer.backend
        self._stream = DecodeStream(ids=prompt_ids, skip_special_tokens=self._skip_special_tokens)
        self._added: dict[int, str] | None = None
        self._last_added = False
        if not (self._skip_special_tokens or self._spaces):
            self._added = self._tokenizer.added_token_text or None

    def decode_next(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):
            logger.warning("cannot detokenize token id %r", token_id)
            text = None
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self._stream = self._new_stream(skip_special_tokens=self._skip_special_tokens)
            text = self._stream.step(self._backend, token_id)
        added = self._added
        if added is not None:
            token = added.get(token_id)
            if token is not None and self._last_added:
                text = token
            self._last_added = token is not None
        return text or ""


class _WindowDecoder(TokenDecoder):
    """The Python incremental algorithm over a growing list of token strings."""

    def _prime(self, prompt_ids: list[int]) -> None:
        self._tokens, self._prefix_offset, self._read_offset = prompt_window(
            self._tokenizer, prompt_ids, self._skip_special_tokens
        )

    def decode_next(self, token_id: int) -> str:
        new_tokens, text, self._prefix_offset, self._read_offset = detokenize_incrementally(
            self._tokenizer,
            token_id,
            self._tokens,
            self._prefix_offset,
            self._read_offset,
            self._skip_special_tokens,
            self._spaces,
        )
        self._tokens.extend(new_tokens)
        return text


def new_token_decoder(
    tokenizer: TextTokenizer,
    prompt_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> TokenDecoder:
    """The decoder vLLM would use for this tokenizer, primed with the prompt."""
    cls = _StreamDecoder if tokenizer.is_fast else _WindowDecoder
    return cls(tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens)
