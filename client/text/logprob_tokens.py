"""The text of each token in a logprobs row, as vLLM 0.32's frontend gives it
(``vllm/tokenizers/detokenizer_utils.py`` ``convert_ids_list_to_tokens`` and
``vllm/v1/engine/logprobs.py`` ``_verify_tokens``): each id decoded alone, the leading
spaces a Metaspace (SentencePiece) tokenizer's decode strips given back, and a text that
ends in U+FFFD (a byte-fallback piece of a multi-byte character) decoded again after up to
4 of the sample's preceding sampled ids, or "" where the character is not complete yet."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = ["LogprobTokenText"]

_REPLACEMENT = "\ufffd"
_MAX_CONTEXT = 4  # enough for any UTF-8 sequence


class LogprobTokenText:
    """``text(token_id, context)``: a candidate's text after ``context`` (the sample's
    sampled ids before this position, oldest first)."""

    def __init__(self, tokenizer: Any):
        self.hf = tokenizer.hf
        self.marker = _leading_space_marker(self.hf)

    def alone(self, token_id: int) -> str:
        text = self.hf.decode([token_id]) or ""
        if self.marker is None:
            return text
        raw = self.hf.convert_ids_to_tokens([token_id])[0] or ""
        markers = len(raw) - len(raw.lstrip(self.marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def text(self, token_id: int, context: Sequence[int]) -> str:
        text = self.alone(token_id)
        if not text.endswith(_REPLACEMENT):
            return text
        return self._completed(token_id, list(context[-_MAX_CONTEXT:]))

    def _completed(self, token_id: int, context: list[int]) -> str:
        """vLLM's ``_correct_decoded_token``: the text this token completes after the
        shortest run of preceding ids that ends its character; "" when none does."""
        decode = self.hf.decode
        for count in range(1, len(context) + 1):
            before = context[-count:]
            whole = decode(before + [token_id])
            if whole.endswith(_REPLACEMENT):
                continue
            clean_end = len(before)
            for j in range(len(before) - 1, -1, -1):
                if decode([before[j]]).endswith(_REPLACEMENT):
                    clean_end = j
                else:
                    break
            prefix = decode(before[:clean_end]) if clean_end > 0 else ""
            if whole.startswith(prefix):
                return whole[len(prefix) :]
            common = 0
            for a, b in zip(prefix, whole, strict=False):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""


def _leading_space_marker(hf: Any) -> str | None:
    """The Metaspace replacement character of a fast tokenizer's pre-tokenizer, if any."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        config = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a backend that cannot say: none
        return None
    pre = config.get("pre_tokenizer") or {}
    if pre.get("type") == "Metaspace":
        return pre.get("replacement", "▁")
    if pre.get("type") == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return sub.get("replacement", "▁")
    return None
