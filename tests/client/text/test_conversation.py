"""Conversation: token-exact turns. Where tokenization is stable its ids equal the chat
template applied to the whole conversation; where retokenizing the text gives other ids it
keeps the ids as sampled; bad input is refused before anything is sent."""

from __future__ import annotations

import pytest

from client.text import Conversation, TextError, TextParams, load_tokenizer
from codec import FinishReason, Logprobs
from tests.text_models import ensure_tokenizer


@pytest.fixture(scope="module", params=["bpe", "sp-fast", "sp-slow"])
def tokenizer(request: pytest.FixtureRequest):  # noqa: ANN201
    return load_tokenizer(ensure_tokenizer(request.param))


def _template(tokenizer, messages, generation=True) -> list[int]:  # noqa: ANN001
    ids = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=generation)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("ended_by", [FinishReason.STOP, FinishReason.LENGTH])
def test_stable_tokenization_gives_the_templates_ids(tokenizer, ended_by) -> None:  # noqa: ANN001
    """Completions sampled as the template would tokenize them in place (SentencePiece
    tokenizes a word differently at the start of a string); ended with EOS, or without
    (the template's end of turn is added)."""
    replies = ["Hello café, 日本語 😀.", "Second answer — naïve"]
    user = [
        {"role": "user", "content": "What is café?"},
        {"role": "user", "content": "And 東京?"},
        {"role": "user", "content": "Thanks"},
    ]
    conversation = Conversation.start(tokenizer, user[:1])
    assert conversation.prompt_ids == _template(tokenizer, user[:1])
    messages = list(user[:1])
    for turn, reply in enumerate(replies):
        prompt = conversation.prompt_ids
        in_place = _template(tokenizer, [*messages, {"role": "assistant", "content": reply}], False)
        assert in_place[: len(prompt)] == prompt
        tail = in_place[len(prompt) :]
        ids = tail[: tail.index(tokenizer.eos_token_id)]
        if ended_by == FinishReason.STOP:
            ids.append(tokenizer.eos_token_id)
        conversation.add_completion(ids, [-0.5] * len(ids))
        messages += [{"role": "assistant", "content": reply}, user[turn + 1]]
        conversation.add_messages([user[turn + 1]])
        assert conversation.prompt_ids == _template(tokenizer, messages)
    sampled = [i for i, s in enumerate(conversation.sampled_mask) if s]
    assert len(sampled) == sum(t.end - t.start for t in conversation.turns if t.sampled)
    assert all(conversation.sampled_logprobs[i] == -0.5 for i in sampled)
    assert [t.sampled for t in conversation.turns] == [False, True, False, True, False]
    assert conversation.turns[-1].end == len(conversation.token_ids)


def test_sampled_ids_are_kept_where_retokenizing_differs() -> None:
    """A completion sampled as single bytes of multi-byte characters: its text tokenizes to
    other ids, and so does the template on the conversation's text; the conversation keeps
    the sampled ids, and the next prompt extends them exactly."""
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    backend_vocab = tokenizer.hf.get_vocab()
    # "café 日本" one byte-level piece per byte: what a sampler may produce.
    pieces = [tokenizer.hf.convert_tokens_to_ids(c) for c in "caf"]
    pieces += [backend_vocab[b] for b in ("Ã", "©")]  # é as two byte tokens
    text = tokenizer.decode(pieces)
    assert text == "café"
    assert tokenizer.encode(text) != pieces
    user = [{"role": "user", "content": "Say café"}]
    conversation = Conversation.start(tokenizer, user)
    prompt = conversation.prompt_ids
    logprobs = Logprobs([[i] for i in pieces], [[-1.0 - i] for i in range(5)], [1] * 5)
    conversation.add_completion(pieces, logprobs)
    conversation.add_messages([{"role": "user", "content": "again"}])
    assert conversation.token_ids[: len(prompt)] == prompt
    assert conversation.token_ids[len(prompt) : len(prompt) + 5] == pieces
    assert conversation.sampled_logprobs[len(prompt) : len(prompt) + 5] == [
        -1.0, -2.0, -3.0, -4.0, -5.0,
    ]  # fmt: skip
    retokenized = _template(tokenizer, conversation.messages)
    assert retokenized != conversation.token_ids  # what retokenizing would have trained on
    assert conversation.messages[1] == {"role": "assistant", "content": "café"}


def test_tool_messages_and_template_kwargs(tokenizer) -> None:  # noqa: ANN001
    """Observations as messages of any role the template knows; kwargs reach the template."""
    conversation = Conversation.start(tokenizer, [{"role": "user", "content": "call a tool"}])
    conversation.add_completion(tokenizer.encode("calling"))
    added = conversation.add_messages([{"role": "tool", "content": "\nObservation: 42"}])
    assert tokenizer.decode(added, skip_special_tokens=False).count("Observation: 42") == 1


def test_bad_input_is_refused(tmp_path) -> None:  # noqa: ANN001
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    with pytest.raises(TextError, match="not a folder"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(TextError, match="holds no tokenizer files.*--tokenizer"):
        load_tokenizer(tmp_path)  # e.g. the tiny model's folder: its tokenizer is elsewhere
    with pytest.raises(TextError, match="empty list"):
        TextParams(stop=[])
    with pytest.raises(TextError, match="must not be empty"):
        TextParams(stop=["</answer>", ""])
    with pytest.raises(TextError, match="list of strings"):
        TextParams(stop=[b"x"])  # type: ignore[list-item]
    with pytest.raises(TextError, match="non-empty list"):
        Conversation.start(tokenizer, [])
    with pytest.raises(TextError, match="'role'"):
        Conversation.start(tokenizer, [{"content": "no role"}])
    strict = load_tokenizer(ensure_tokenizer("bpe"))
    strict.hf.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('tool messages are not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    conversation = Conversation.start(strict, [{"role": "user", "content": "hi"}])
    conversation.add_completion([5, 6])
    with pytest.raises(TextError, match="cannot render.*tool messages are not supported"):
        conversation.add_messages([{"role": "tool", "content": "x"}])
    with pytest.raises(TextError, match="no completion yet"):
        Conversation.start(strict, [{"role": "user", "content": "hi"}]).add_messages(
            [{"role": "user", "content": "again"}]
        )
    with pytest.raises(TextError, match="2 logprobs for 3"):
        Conversation.start(tokenizer, [{"role": "user", "content": "hi"}]).add_completion(
            [1, 2, 3], [0.0, 0.0]
        )


def test_a_completion_ending_in_the_start_of_the_end_of_turn_text_still_gets_it() -> None:
    """A completion cut by length right after "<" (the first character of "<|im_end|>"):
    the end-of-turn token is still added; only a sampled special token stands for it."""
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    less_than = tokenizer.hf.convert_tokens_to_ids("<")
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    conversation = Conversation.start(tokenizer, [{"role": "user", "content": "hi"}])
    conversation.add_completion([less_than])
    added = conversation.add_messages([{"role": "user", "content": "again"}])
    assert added[0] == im_end
    conversation.add_completion([less_than, im_end])
    assert conversation.add_messages([{"role": "user", "content": "more"}])[0] != im_end
