"""SampleText (sans-IO): logprobs follow the kept ids, prompt logprobs pass through, and a
non-streaming sample gives its whole text once, at its end."""

import pytest

from client.text import AsyncTextClient, SampleText, TextError, TextParams, load_tokenizer
from codec import Finished, FinishReason, Logprobs, RequestOutput, SamplingParams
from tests.text_models import ensure_tokenizer


def _rows(ids: list[int]) -> Logprobs:
    return Logprobs([[i] for i in ids], [[-float(i)] for i in ids], [1] * len(ids))


def test_logprobs_are_cut_with_the_ids_and_prompt_logprobs_pass_through() -> None:
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    ids = tokenizer.encode("hello world and more")
    stop_after = tokenizer.decode(ids[:2])  # completed by the second id
    prompt = tokenizer.encode("say")
    prompt_rows = _rows(prompt)
    for delta in (True, False):
        sample = SampleText(tokenizer, prompt, TextParams(stop=[stop_after[-2:]]), delta=delta)
        out = sample.add(RequestOutput("r", ids, None, _rows(ids), prompt_rows))
        assert out.done and out.stop_reason == stop_after[-2:] and out.finished is None
        assert out.token_ids == ids[:2]
        assert out.logprobs == _rows(ids[:2]) and out.prompt_logprobs == prompt_rows
        assert out.text == stop_after[:-2]


def test_a_non_streaming_sample_gives_its_text_at_its_end() -> None:
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    ids = tokenizer.encode("café 日本語")
    sample = SampleText(tokenizer, [1], TextParams(), delta=False)
    first = sample.add(RequestOutput("r", ids[:2]))
    assert first.text == "" and not first.done
    end = Finished(FinishReason.LENGTH, None, 1, len(ids))
    last = sample.add(RequestOutput("r", ids[2:], end, _rows(ids[2:])))
    assert last.text == "café 日本語" and last.token_ids == ids and last.finished == end


def test_a_token_stop_sequence_keeps_its_ids_in_the_text() -> None:
    """The gateway's token stop sequences end a sample with stop_reason the sequence and the
    ids it kept (include_stop_sequence decides, at the gateway): their text is all there,
    unlike a stop token id's, which vLLM leaves out of the text."""
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    ids = tokenizer.encode("hello world")
    by_sequence = Finished(FinishReason.STOP, ids[-1:], 1, len(ids))
    sample = SampleText(tokenizer, [1], TextParams())
    out = sample.add(RequestOutput("r", ids, by_sequence))
    assert out.text == "hello world" and out.stop_reason == ids[-1:]
    by_token = Finished(FinishReason.STOP, ids[-1], 1, len(ids))
    sample = SampleText(tokenizer, [1], TextParams())
    out = sample.add(RequestOutput("r", ids, by_token))
    assert out.text == tokenizer.decode(ids[:-1]) and out.token_ids == ids


def test_streaming_stop_sequences_without_hold_back_are_refused_with_text() -> None:
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))

    class NoClient:
        def generate(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise AssertionError("nothing may be sent")

    sampling = SamplingParams(stop_token_sequences=[[5, 6]], hold_back_stop_sequences=False)
    with pytest.raises(TextError, match="hold_back_stop_sequences=False"):
        AsyncTextClient(NoClient(), tokenizer).generate([1, 2], sampling)
