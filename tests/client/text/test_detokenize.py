"""The client's text equals vLLM's front-end, delta by delta, for a byte-level BPE, a fast
SentencePiece, a slow (Python) SentencePiece and a WordPiece tokenizer: random ids (split
multi-byte characters, special tokens side by side), one or several ids per step, stop strings
taken from the text (inside one token and across several), every text option."""

from __future__ import annotations

import random
import re

import pytest

from client.text import SampleText, TextParams, load_tokenizer
from codec import Finished, FinishReason, RequestOutput
from tests.client.text.vllm_detokenizer import vllm_steps
from tests.text_models import ensure_tokenizer

KINDS = ["bpe", "sp-fast", "sp-slow", "wordpiece"]


@pytest.fixture(scope="module", params=KINDS)
def tokenizer_kind(request: pytest.FixtureRequest):  # noqa: ANN201
    path = ensure_tokenizer(request.param)
    return str(path), load_tokenizer(path)


_PARTS: dict[int, list[int]] = {}


def _partial_characters(tokenizer) -> list[int]:  # noqa: ANN001
    """Byte tokens: ids whose text alone is not whole UTF-8 (parts of a character), or a
    byte-fallback piece ``<0xNN>``."""
    key = id(tokenizer)
    if key not in _PARTS:
        vocab = min(tokenizer.vocab_size, 32768)
        pieces = tokenizer.hf.convert_ids_to_tokens(list(range(vocab)))
        _PARTS[key] = [
            i
            for i in range(vocab)
            if "\ufffd" in tokenizer.decode([i]) or re.fullmatch("<0x[0-9A-F]{2}>", pieces[i])
        ]
    return _PARTS[key]


def _random_ids(rng: random.Random, tokenizer, count: int, specials: float) -> list[int]:  # noqa: ANN001
    special = sorted(tokenizer.all_special_ids)
    parts = _partial_characters(tokenizer)
    vocab = min(tokenizer.vocab_size, 32768)  # the fast SentencePiece has 32768 ids
    ids = []
    for _ in range(count):
        if rng.random() < specials:
            ids.append(rng.choice(special))
        elif parts and rng.random() < 0.3:
            ids.append(rng.choice(parts))
        else:
            ids.append(rng.randrange(vocab))
    return ids


def _client_steps(tokenizer, prompt, steps, eos_at_end, params, min_tokens):  # noqa: ANN001, ANN202
    sample = SampleText(tokenizer, prompt, params, min_tokens=min_tokens)
    out = []
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        finished = None
        if last:
            reason = FinishReason.STOP if eos_at_end else FinishReason.LENGTH
            total = sum(len(s) for s in steps)
            finished = Finished(reason, None, len(prompt), total)
        result = sample.add(RequestOutput("r", list(ids), finished))
        out.append((result.text, result.token_ids, result.stop_reason))
        if result.done:
            break
    return out, sample


@pytest.mark.parametrize("seed", range(40))
def test_text_equals_vllm(tokenizer_kind, seed: int) -> None:
    path, tokenizer = tokenizer_kind
    rng = random.Random(seed)
    specials = rng.choice([0.05, 0.05, 0.4])  # dense: added tokens side by side
    prompt = _random_ids(rng, tokenizer, rng.randint(1, 12), specials)
    output = _random_ids(rng, tokenizer, rng.randint(1, 40), specials)
    steps, i = [], 0
    while i < len(output):
        size = 1 if rng.random() < 0.7 else rng.randint(2, 4)
        steps.append(output[i : i + size])
        i += size
    skip = rng.random() < 0.7
    spaces = rng.random() < 0.7
    full = tokenizer.decode(output, skip_special_tokens=skip)
    stop = None
    if full and rng.random() < 0.8:  # stops cut from the text: within a token, across tokens
        stop = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(full))
            stop.append(full[start : start + rng.randint(1, 6)])
        if rng.random() < 0.3:
            stop.append("never in the text \u2603")
    include = rng.random() < 0.4
    min_tokens = rng.choice([0, 0, 0, 2, 5])
    eos_at_end = rng.random() < 0.5
    expected = vllm_steps(
        path, prompt, steps, eos_at_end=eos_at_end, stop=stop,
        include_stop_str_in_output=include, min_tokens=min_tokens,
        skip_special_tokens=skip, spaces_between_special_tokens=spaces,
    )  # fmt: skip
    params = TextParams(
        stop=stop, include_stop_str_in_output=include, skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
    )  # fmt: skip
    got, sample = _client_steps(tokenizer, prompt, steps, eos_at_end, params, min_tokens)
    assert got == [(s.text, s.token_ids, s.stop_reason) for s in expected]
    assert sample.text == "".join(s.text for s in expected)
