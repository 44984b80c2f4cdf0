"""Token-level stop sequences: the token twin of vLLM's stop strings, checked by the gateway.

Rules, as vLLM's detokenizer applies them to stop strings (v1/engine/detokenizer.py):
- A sample stops at the first position where any sequence completes; when several
  complete in the same step, the one completing earliest wins, ties by list order.
- A match counts only if it ends after the first ``min_tokens`` output tokens (it may
  begin before them).
- When the engine itself stopped the sample on a stop token (EOS or ``stop_token_ids``),
  that last token is not matched, unless the sequence is to be kept in the output.
- Output is cut right before the matched sequence, or right after it with
  ``include_stop_sequence``; tokens the engine produced after it are dropped.
- Streaming holds back only what might still turn out to be the start of a match: the
  longest tail of the output that is a proper prefix of some sequence (at most the
  longest sequence's length minus one). Nothing sent is ever retracted. With
  ``include_stop_sequence`` nothing needs holding back; ``hold_back=False`` turns it off
  (the client then keeps only ``Finished.output_tokens`` tokens).
Pure: no I/O, no clock. One StopMatcher per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StopMatcher", "StopCheck", "check_stop_sequences"]


def check_stop_sequences(
    sequences: list[list[int]], vocab_size: int, max_count: int, max_len: int
) -> str | None:
    """What is wrong with ``stop_token_sequences`` (vLLM's wording style), or None."""
    if len(sequences) > max_count:
        return f"stop_token_sequences has {len(sequences)} sequences; at most {max_count} allowed."
    for i, sequence in enumerate(sequences):
        if not sequence:
            return f"stop_token_sequences[{i}] is empty; each sequence needs at least one token."
        if len(sequence) > max_len:
            return (
                f"stop_token_sequences[{i}] has {len(sequence)} tokens; at most {max_len} allowed."
            )
        bad = [t for t in sequence if not 0 <= t < vocab_size]
        if bad:
            return (
                f"stop_token_sequences[{i}] has token ids {bad} outside the vocabulary"
                f" (0 <= id < {vocab_size})."
            )
    return None


@dataclass(frozen=True, slots=True)
class StopCheck:
    """What to do with a sample's pending tokens after one engine step.

    ``release``: how many pending tokens (held-back ones first, then this step's) to
    send now. ``matched``: index of the sequence that ended the sample, or None.
    ``kept``: with a match, the sample's total output tokens after the cut.
    """

    release: int
    matched: int | None = None
    kept: int = 0


class StopMatcher:
    """Follows one sample's output tokens and finds the first stop-sequence match."""

    __slots__ = (
        "sequences",
        "include",
        "min_tokens",
        "hold_back",
        "_by_last",
        "_window",
        "_longest",
        "_seen",
        "_sent",
    )

    def __init__(
        self,
        sequences: list[list[int]],
        *,
        include: bool = False,
        min_tokens: int = 0,
        hold_back: bool = True,
    ):
        self.sequences = [list(s) for s in sequences]
        self.include = include
        self.min_tokens = min_tokens
        self.hold_back = hold_back and not include
        # Candidates by last token, in list order: only they can complete at a token.
        self._by_last: dict[int, list[int]] = {}
        for index, sequence in enumerate(self.sequences):
            self._by_last.setdefault(sequence[-1], []).append(index)
        self._longest = max(len(s) for s in self.sequences)
        self._window: list[int] = []  # the last (longest - 1) tokens before this step
        self._seen = 0  # output tokens seen so far
        self._sent = 0  # output tokens released so far

    @property
    def sent(self) -> int:
        return self._sent

    def feed(
        self, new_token_ids: list[int], *, engine_stopped: bool = False, final: bool = False
    ) -> StopCheck:
        """Check one step's new tokens.

        ``final``: the engine ended the sample in this step (nothing is held back then);
        ``engine_stopped``: it ended it on a stop token (EOS or stop_token_ids), which is
        then the last new token.
        """
        window = self._window
        start = self._seen  # output position (0-based) of new_token_ids[0]
        tokens = window + new_token_ids
        offset = len(window)  # index in ``tokens`` of new_token_ids[0]
        last_checkable = len(new_token_ids)
        if engine_stopped and not self.include:
            last_checkable -= 1
        by_last = self._by_last
        for j in range(last_checkable):
            candidates = by_last.get(new_token_ids[j])
            if candidates is None:
                continue
            end = start + j + 1  # output tokens up to and including this one
            if end <= self.min_tokens:
                continue
            for index in candidates:
                sequence = self.sequences[index]
                length = len(sequence)
                first = offset + j + 1 - length
                if first >= 0 and tokens[first : offset + j + 1] == sequence:
                    kept = end if self.include else end - length
                    release = max(kept - self._sent, 0)
                    self._sent += release
                    self._seen += len(new_token_ids)
                    return StopCheck(release, index, kept)
        self._seen += len(new_token_ids)
        keep = self._longest - 1
        self._window = tokens[-keep:] if keep else []
        held = self._held_tail(tokens) if self.hold_back and not final else 0
        release = self._seen - held - self._sent
        self._sent += release
        return StopCheck(release)

    def flush(self) -> int:
        """The sample ends early (abort, deadline): release every held-back token."""
        release = self._seen - self._sent
        self._sent = self._seen
        return release

    def _held_tail(self, tokens: list[int]) -> int:
        """Length of the longest tail of the output that is a proper prefix of a sequence."""
        unsent = self._seen - self._sent  # what was sent cannot be held back
        for k in range(min(self._longest - 1, unsent), 0, -1):
            tail = tokens[-k:]
            for sequence in self.sequences:
                if len(sequence) > k and sequence[:k] == tail:
                    return k
        return 0
