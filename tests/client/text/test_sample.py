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


def test_a_slow_tokenizers_split_character_is_held_until_whole() -> None:
    """The slow path holds back a trailing U+FFFD (a character split over byte-fallback
    pieces) as vLLM does: GPT-SW3's tokenizer decodes such pieces to bytes."""
    tokenizer = load_tokenizer(ensure_tokenizer("gptsw3"))
    assert not tokenizer.is_fast
    ids = tokenizer.encode("ᚠ ok")
    assert len(ids) > 4  # "▁" then three byte pieces for the rune
    sample = SampleText(tokenizer, [1], TextParams())
    deltas = [sample.add(RequestOutput("r", [i])).text for i in ids]
    assert "\ufffd" not in "".join(deltas) and "".join(deltas) == tokenizer.decode(ids)
    assert deltas[1:3] == ["", ""]  # the rune's first two bytes: nothing yet


def test_an_id_past_a_slow_tokenizers_vocabulary_reads_as_nothing() -> None:
    """vLLM's rule: an id outside the tokenizer's vocabulary (the model's may be larger)
    adds no text; the id just at its end included."""
    tokenizer = load_tokenizer(ensure_tokenizer("sp-slow"))
    sample = SampleText(tokenizer, [1], TextParams())
    out = sample.add(RequestOutput("r", [tokenizer.vocab_size, tokenizer.vocab_size + 7]))
    assert out.text == "" and out.token_ids == [tokenizer.vocab_size, tokenizer.vocab_size + 7]


async def test_a_token_the_tokenizer_cannot_read_ends_the_request_with_a_text_error(
    monkeypatch,
) -> None:
    """Issue 67 item 9: an exception from detokenizing leaves the stream as TextError naming
    the id, and the request is aborted (the engine would generate on for nobody)."""
    tokenizer = load_tokenizer(ensure_tokenizer("sp-slow"))
    convert = tokenizer.convert_ids_to_tokens

    def failing(ids, skip_special_tokens):
        if 777 in ids:
            raise IndexError("piece id is out of range")
        return convert(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "convert_ids_to_tokens", failing)

    class Requests:
        request_id = "r-bad"
        closed = False

        def __init__(self):
            self.outputs = iter([RequestOutput("r-bad", [5, 6]), RequestOutput("r-bad", [777])])

        async def __anext__(self):
            return next(self.outputs)

        async def aclose(self):
            self.closed = True

    requests = Requests()

    class Client:
        def generate(self, *args, **kwargs):
            return requests

    stream = AsyncTextClient(Client(), tokenizer).generate([1], SamplingParams())
    first = await stream.__anext__()
    assert first.token_ids == [5, 6] and not requests.closed
    with pytest.raises(TextError, match=r"r-bad.*token id 777.*IndexError"):
        await stream.__anext__()
    assert requests.closed


def test_a_mistral_format_folder_and_a_malformed_config_are_text_errors(tmp_path) -> None:
    """Issue 67 items 10 and 11: vLLM's tokenizer mode auto reads a Mistral-format folder
    with mistral-common's tokenizer, whose text differs from the Hugging Face files beside
    it: refused by name. A tokenizer_config.json holding a list is a TextError, not an
    AttributeError."""
    import shutil

    mistral = tmp_path / "mistral"
    shutil.copytree(ensure_tokenizer("sp-fast"), mistral)
    (mistral / "consolidated.safetensors").write_bytes(b"")
    (mistral / "tokenizer.model.v3").write_bytes(b"")
    with pytest.raises(TextError, match=r"Mistral-format.*consolidated\.safetensors.*v3"):
        load_tokenizer(mistral)
    (mistral / "tokenizer.model.v3").unlink()
    assert load_tokenizer(mistral).vocab_size > 0  # weights alone: vLLM takes the HF files
    broken = tmp_path / "broken"
    shutil.copytree(ensure_tokenizer("sp-fast"), broken)
    (broken / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TextError, match="no tokenizer could be loaded"):
        load_tokenizer(broken)


def test_a_client_stop_clears_the_gateways_terminal_and_an_empty_stop_terminal_is_fine() -> None:
    """Mutants the suite let live: ``finished`` kept when the client's stop string ended the
    sample in the same output as the gateway's terminal (the sample's end is the client's),
    and a STOP terminal that carries no ids (the last token held back by a stop
    sequence) indexing into nothing."""
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    ids = tokenizer.encode("hello world")
    end = Finished(FinishReason.LENGTH, None, 1, len(ids))
    sample = SampleText(tokenizer, [1], TextParams(stop=["world"]))
    out = sample.add(RequestOutput("r", ids, end))
    assert out.stop_reason == "world" and out.finished is None
    assert out.finish_reason is FinishReason.STOP
    stop = Finished(FinishReason.STOP, 2, 1, 0)
    sample = SampleText(tokenizer, [1], TextParams())
    out = sample.add(RequestOutput("r", [], stop))
    assert out.done and out.token_ids == [] and out.text == "" and out.finished == stop
