"""Text options of a request, and vLLM's stop-string rule (its ``check_stop_strings``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .tokenizer import TextError

__all__ = ["TextParams", "check_stop_strings"]


@dataclass(frozen=True, slots=True)
class TextParams:
    """vLLM's text-side SamplingParams fields, applied by the client.

    ``stop``: strings that end a sample when its text contains one (the one that completes
    earliest wins, ties by list order); the text is cut before it unless
    ``include_stop_str_in_output``. ``skip_special_tokens`` and
    ``spaces_between_special_tokens`` as vLLM's (defaults true).
    """

    stop: Sequence[str] | str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        stop = () if self.stop is None else self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise TextError(f"stop must be a list of strings, got {self.stop!r}")
        if self.stop is not None and len(stop) == 0:
            raise TextError("stop is an empty list: pass None for no stop strings")
        if any(s == "" for s in stop):
            raise TextError("stop strings must not be empty (an empty string matches at once)")
        object.__setattr__(self, "stop", tuple(stop) or None)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings (none: an empty tuple)."""
        return self.stop or ()  # type: ignore[return-value]

    @property
    def hold_back(self) -> int:
        """Characters a streamed delta keeps back, in case they begin a stop string."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0


def check_stop_strings(
    output_text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The stop string found in the last ``new_char_count`` characters (and the ones a
    stop could span into them), and the length the text is cut to (-1: no cut); None
    when no stop string completes there."""
    if not new_char_count or not stop:
        return None
    best: str | None = None
    best_index = 0
    best_end = sys.maxsize
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if end < best_end:
            best, best_index, best_end = stop_str, index, end
    if best is None:
        return None
    if include_in_output:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index
