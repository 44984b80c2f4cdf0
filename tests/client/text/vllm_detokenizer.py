"""vLLM's own front-end text path, in process, as the oracle for the client's: its
IncrementalDetokenizer (fast or slow, as vLLM picks) on vLLM's cached tokenizer, fed one
engine step at a time as its output processor does."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace


@dataclass
class Step:
    text: str
    token_ids: list[int]
    stop_reason: str | None


def vllm_steps(
    tokenizer_dir: str,
    prompt_ids: list[int],
    steps: list[list[int]],
    *,
    eos_at_end: bool,
    stop: list[str] | None,
    include_stop_str_in_output: bool = False,
    min_tokens: int = 0,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> list[Step]:
    """What vLLM streams (delta text, kept ids, stop string) for each engine step; the
    last step ends the request (EOS when ``eos_at_end``) unless a stop string ends it first."""
    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    tokenizer = _tokenizer(tokenizer_dir, get_tokenizer)
    params = SamplingParams(
        stop=stop,
        include_stop_str_in_output=include_stop_str_in_output,
        min_tokens=min_tokens,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        max_tokens=None,
    )
    request = SimpleNamespace(
        request_id="r", sampling_params=params, prompt_token_ids=list(prompt_ids),
        prompt_embeds=None,
    )  # fmt: skip
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    out = []
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        before = detokenizer.num_output_tokens()
        stop_string = detokenizer.update(list(ids), last and eos_at_end)
        kept = detokenizer.num_output_tokens() - before
        finished = last or stop_string is not None
        text = detokenizer.get_next_output_text(finished, True)
        out.append(Step(text, list(ids[:kept]), stop_string))
        if stop_string is not None:
            break
    return out


_TOKENIZERS: dict[str, object] = {}


def _tokenizer(path: str, get_tokenizer):  # noqa: ANN001, ANN202
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = get_tokenizer(path)
    return _TOKENIZERS[path]
