"""Request sets for ``engine-gateway bench``: token ids and output lengths, seeded.

Rule: pure functions of their arguments (no sockets, no clock); token ids are
drawn from [0, vocab_size) of the gateway's model (HelloAck.model.vocab_size).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BenchRequest",
    "DatasetError",
    "length_range",
    "random_requests",
    "jsonl_requests",
    "prefix_requests",
    "check_fits",
]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a run: its prompt ids and how many tokens to generate."""

    prompt: list[int]
    max_tokens: int


class DatasetError(ValueError):
    """A dataset that cannot be used (bad file line, impossible lengths)."""


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """[length * (1 - r), length * (1 + r)], as vLLM's random dataset draws lengths."""
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(length * (1 - range_ratio)))
    return low, max(low, int(length * (1 + range_ratio)))


def _ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]


def random_requests(
    count: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    *,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random prompts; lengths uniform in ``length_range`` (fixed when range_ratio is 0)."""
    rng = random.Random(seed)
    inputs, outputs = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    return [
        BenchRequest(_ids(rng, rng.randint(*inputs), vocab_size), rng.randint(*outputs))
        for _ in range(count)
    ]


def prefix_requests(
    count: int,
    groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    *,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """``groups`` shared prefixes of ``prefix_len`` tokens, each request one of them plus a
    random suffix of about ``input_len`` tokens (prefix-cache tests). Groups interleave."""
    if groups < 1 or prefix_len < 1:
        raise DatasetError("prefix groups and prefix length must be at least 1")
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab_size) for _ in range(groups)]
    suffixes, outputs = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    return [
        BenchRequest(
            prefixes[i % groups] + _ids(rng, rng.randint(*suffixes), vocab_size),
            rng.randint(*outputs),
        )
        for i in range(count)
    ]


def jsonl_requests(
    path: str | Path, vocab_size: int, *, count: int | None = None, seed: int = 0
) -> list[BenchRequest]:
    """One request per line: ``{"prompt_token_ids": [...], "max_tokens": N}`` or
    ``{"input_len": N, "output_len": M}`` (random ids of that length). Lines cycle
    when ``count`` exceeds them; blank lines are skipped."""
    rng = random.Random(seed)
    rows: list[BenchRequest] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rows.append(_jsonl_row(json.loads(line), rng, vocab_size))
            except (ValueError, TypeError, KeyError) as exc:
                raise DatasetError(f"{path}:{number}: {exc}") from None
    if not rows:
        raise DatasetError(f"{path}: no requests")
    if count is None:
        return rows
    return [rows[i % len(rows)] for i in range(count)]


def _jsonl_row(row: object, rng: random.Random, vocab_size: int) -> BenchRequest:
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    if "prompt_token_ids" in row:
        prompt = row["prompt_token_ids"]
        if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
            raise ValueError("prompt_token_ids: expected a non-empty list of ids >= 0")
        return BenchRequest(list(prompt), _positive(row, "max_tokens"))
    return BenchRequest(
        _ids(rng, _positive(row, "input_len"), vocab_size), _positive(row, "output_len")
    )


def _positive(row: dict, key: str) -> int:
    value = row[key]
    if type(value) is not int or value < 1:
        raise ValueError(f"{key}: expected an int >= 1, got {value!r}")
    return value


def check_fits(
    requests: list[BenchRequest], max_model_len: int, max_prompt_tokens: int
) -> str | None:
    """Check a request set against the gateway's model (from its HelloAck).

    Raises DatasetError when a prompt is longer than the gateway takes (every such request
    would be refused): at most ``max_prompt_tokens``, and at most ``max_model_len`` - 1 so
    that one output token fits. Returns a warning when some prompt + output exceeds
    ``max_model_len`` (those outputs end early, at the context's end), else None.
    """
    if not requests:
        return None
    longest = max(len(r.prompt) for r in requests)
    fits = min(max_model_len - 1, max_prompt_tokens)
    if longest > fits:
        too_long = sum(len(r.prompt) > fits for r in requests)
        raise DatasetError(
            f"{too_long} of {len(requests)} prompts are longer than this gateway takes"
            f" (longest {longest} tokens; it takes at most {fits}: max_model_len"
            f" {max_model_len} leaves room for one output token, max_prompt_tokens"
            f" {max_prompt_tokens}); use shorter prompts (--input-len, --prefix-len)"
        )
    capped = [r for r in requests if len(r.prompt) + r.max_tokens > max_model_len]
    if not capped:
        return None
    most = max(len(r.prompt) + r.max_tokens for r in capped)
    return (
        f"{len(capped)} of {len(requests)} requests ask for more tokens than the model's"
        f" context holds (prompt + output up to {most}, max_model_len {max_model_len}):"
        " their outputs stop at the context's end, shorter than asked"
    )
