"""One sample's text, as vLLM's front-end keeps it: its token ids detokenized as they
arrive, stop strings checked on the new text, streamed deltas held back by the longest
stop string, and the ids and text cut where a stop string completes
(``BaseIncrementalDetokenizer.update`` and the output processor, vLLM v0.32)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from codec import Finished, FinishReason, Logprobs, RequestOutput

from .detokenizer import new_token_decoder
from .stop_strings import TextParams, check_stop_strings
from .tokenizer import TextError, TextTokenizer

__all__ = ["SampleText", "TextOutput"]


@dataclass(slots=True)
class TextOutput:
    """What one RequestOutput adds to a sample's text.

    Streaming: ``text`` is the new text and ``token_ids`` (with ``logprobs``) the ids it
    came from; text of ids not yet whole (a split UTF-8 character, a possible stop string)
    comes in a later output. Not streaming: one output per sample, with all its text and ids.
    ``finish_reason``/``stop_reason`` on a sample's last output: ``stop_reason`` is a stop
    token id, a token stop sequence, or the stop string that ended it. ``finished`` is the
    gateway's terminal (None when the client ended the sample on a stop string).
    ``prompt_logprobs`` as the gateway sent them (on a sample's first output).
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | list[int] | str | None = None
    finished: Finished | None = None
    prompt_logprobs: Logprobs | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class SampleText:
    """The text state of one sample (sans-IO): feed it the sample's RequestOutputs."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        prompt_ids: Sequence[int],
        params: TextParams,
        *,
        min_tokens: int = 0,
        delta: bool = True,
    ):
        self._tokenizer = tokenizer
        self._prompt_ids = list(prompt_ids)
        self._params = params
        self._stop = params.stop_strings
        self._min_tokens = min_tokens
        self._delta = delta
        self._hold_back = params.hold_back
        self._decoder = self._new_decoder()
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: Logprobs | None = None
        self.prompt_logprobs: Logprobs | None = None
        self._sent = 0  # characters of text already given out (streaming)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | list[int] | str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _new_decoder(self):  # noqa: ANN202 - TokenDecoder
        params = self._params
        return new_token_decoder(
            self._tokenizer,
            self._prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    def add(self, out: RequestOutput) -> TextOutput:
        """Fold in the sample's next output; the text and ids it adds."""
        fin = out.finished
        new_ids = out.new_token_ids
        num_prev = len(self.token_ids)
        # EOS or a stop token id: its text is left out unless include_stop_str_in_output.
        stop_token = (
            fin is not None
            and fin.finish_reason == FinishReason.STOP
            and not isinstance(fin.stop_reason, list)
        )
        stop_string = self._update(new_ids, stop_token)
        kept = len(self.token_ids) - num_prev
        logprobs = Logprobs.rows(out.logprobs, 0, kept) if kept < len(new_ids) else out.logprobs
        self.logprobs = Logprobs.concat(self.logprobs, logprobs)
        self.prompt_logprobs = Logprobs.concat(self.prompt_logprobs, out.prompt_logprobs)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP, stop_string
            fin = None
        elif fin is not None:
            self.finish_reason, self.stop_reason = fin.finish_reason, fin.stop_reason
        finished = self.finish_reason is not None
        if self._delta:
            return TextOutput(
                out.request_id,
                out.index,
                self._next_text(finished),
                self.token_ids[num_prev:],
                logprobs,
                self.finish_reason,
                self.stop_reason,
                fin,
                out.prompt_logprobs,
            )
        return TextOutput(
            out.request_id,
            out.index,
            self.text if finished else "",
            list(self.token_ids),
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
            fin,
            self.prompt_logprobs,
        )

    def _update(self, new_ids: list[int], stop_token: bool) -> str | None:
        """vLLM's ``update``: detokenize, then look for a stop string in the new text."""
        if not new_ids:
            return None
        skipped = None
        if stop_token and not self._params.include_stop_str_in_output:
            skipped, new_ids = new_ids[-1], new_ids[:-1]
        num_prev = len(self.token_ids)
        offsets = [len(self.text)] if self._stop else None
        decode_next = self._decoder.decode_next
        for token_id in new_ids:
            self.token_ids.append(token_id)
            try:
                self.text += decode_next(token_id)
            except Exception as exc:  # vLLM's detokenizer raises here too: the sample is over
                raise TextError(
                    f"token id {token_id} cannot be detokenized by this tokenizer"
                    f" ({type(exc).__name__}: {exc})"
                ) from exc
            if offsets is not None:
                offsets.append(len(self.text))
        if skipped is not None:
            self.token_ids.append(skipped)
            if offsets is not None:
                offsets.append(len(self.text))
        if offsets is None or len(self.token_ids) <= self._min_tokens:
            return None
        check_from = offsets[max(self._min_tokens - num_prev, 0)]
        found = check_stop_strings(
            self.text,
            len(self.text) - check_from,
            self._stop,
            self._params.include_stop_str_in_output,
        )
        if found is None:
            return None
        stop_string, truncate_to = found
        stop_end = len(self.text) if truncate_to == -1 else truncate_to
        if not self._params.include_stop_str_in_output:
            stop_end += len(stop_string)
        # Ids past the one that completed the stop string are dropped.
        del self.token_ids[num_prev + bisect_left(offsets, stop_end, lo=1) :]
        if truncate_to != -1:
            self.text = self.text[:truncate_to]
        return stop_string

    def _next_text(self, finished: bool) -> str:
        """vLLM's ``get_next_output_text`` for a delta: new text, less the held-back tail."""
        end = len(self.text) - (0 if finished else self._hold_back)
        if self._sent >= end:
            return ""
        start, self._sent = self._sent, end
        return self.text[start:end]
