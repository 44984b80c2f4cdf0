"""vLLM's Python incremental detokenization, for tokenizers that are not
``tokenizers``-backed (vllm/tokenizers/detokenizer_utils.py, v0.32, itself after
text-generation-inference): the text of each new token is the decode of a short window
of tokens minus the decode of that window without it, so that cleanup rules which look
at neighbours (spaces, byte fallback) give the text a full decode would."""

from __future__ import annotations

from .tokenizer import TextTokenizer

__all__ = ["PromptWindow", "prompt_window", "detokenize_incrementally"]

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: how many prompt tokens prime the window.
_PROMPT_WINDOW = 5

PromptWindow = tuple[list[str], int, int]


def prompt_window(
    tokenizer: TextTokenizer, prompt_ids: list[int], skip_special_tokens: bool
) -> PromptWindow:
    """The last prompt tokens as strings, and the prefix and read offsets into them."""
    tokens = tokenizer.convert_ids_to_tokens(
        prompt_ids[-_PROMPT_WINDOW - 2 :], skip_special_tokens=skip_special_tokens
    )
    tokens = [token if token is not None else "" for token in tokens]
    read_offset = len(tokens)
    return tokens, max(read_offset - _PROMPT_WINDOW, 0), read_offset


def _tokens_to_string(
    tokenizer: TextTokenizer,
    tokens: list[str],
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> str:
    """Added tokens are kept whole (never merged by the tokenizer's decoder), as
    transformers' slow decode does."""
    if tokenizer.is_fast or not tokenizer.added_vocab:
        return tokenizer.convert_tokens_to_string(tokens)
    special = tokenizer.all_special_tokens if skip_special_tokens else ()
    added = tokenizer.added_vocab
    sub_texts: list[str] = []
    current: list[str] = []
    for token in tokens:
        if token in special:
            continue
        if token in added:
            if current:
                sub_texts.append(tokenizer.convert_tokens_to_string(current))
                current = []
            sub_texts.append(token)
        else:
            current.append(token)
    if current:
        sub_texts.append(tokenizer.convert_tokens_to_string(current))
    return (" " if spaces_between_special_tokens else "").join(sub_texts)


def detokenize_incrementally(
    tokenizer: TextTokenizer,
    new_token_id: int,
    prev_tokens: list[str],
    prefix_offset: int,
    read_offset: int,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> tuple[list[str], str, int, int]:
    """The new token's strings (none for a skipped special token), the text it adds, and
    the next prefix and read offsets.

    The text is empty while it is not yet whole: nothing new, or a trailing U+FFFD (a
    multi-byte character split over byte-fallback tokens, held until its last byte)."""
    if 0 <= new_token_id < tokenizer.vocab_size:
        new_tokens = tokenizer.convert_ids_to_tokens(
            [new_token_id], skip_special_tokens=skip_special_tokens
        )
        new_tokens = [new_tokens] if isinstance(new_tokens, str) else new_tokens
        new_tokens = [token if token is not None else "" for token in new_tokens]
    else:
        new_tokens = [""]
    window_start = min(prefix_offset, read_offset, len(prev_tokens))
    window = prev_tokens[window_start:] + new_tokens
    prefix_text = _tokens_to_string(
        tokenizer,
        window[prefix_offset - window_start : read_offset - window_start],
        skip_special_tokens,
        spaces_between_special_tokens,
    )
    new_text = _tokens_to_string(
        tokenizer,
        window[prefix_offset - window_start :],
        skip_special_tokens,
        spaces_between_special_tokens,
    )
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return new_tokens, "", prefix_offset, read_offset
    count = len(prev_tokens) + len(new_tokens)
    return new_tokens, new_text[len(prefix_text) :], read_offset, count
