"""Loading a Hugging Face tokenizer as vLLM's ``hf`` tokenizer mode does, with the
properties the detokenizers read every token computed once."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["TextError", "TextTokenizer", "load_tokenizer"]


class TextError(ValueError):
    """Text-side input the client cannot use (a tokenizer, a template, stop strings);
    raised before anything is sent."""


class TextTokenizer:
    """A Hugging Face tokenizer and what the detokenizers need of it, read once.

    ``hf``: the transformers tokenizer itself (``apply_chat_template``, ``encode``...).
    ``is_fast``: a ``tokenizers``-backed tokenizer; vLLM detokenizes those with the
    library's ``DecodeStream`` and every other one with its Python incremental algorithm.
    """

    def __init__(self, hf: Any):
        try:
            from transformers import TokenizersBackend as FastTokenizer  # transformers 5
        except ImportError:  # pragma: no cover - transformers 4
            from transformers import PreTrainedTokenizerFast as FastTokenizer

        self.hf = hf
        self.is_fast = isinstance(hf, FastTokenizer)
        self.backend = hf._tokenizer if self.is_fast else None
        self.vocab_size = len(hf)
        self.all_special_ids = frozenset(hf.all_special_ids)
        self.all_special_tokens = frozenset(hf.all_special_tokens)
        self.added_vocab = frozenset(hf.get_added_vocab())
        self.added_token_text = {
            token_id: token.content for token_id, token in hf.added_tokens_decoder.items()
        }
        self.eos_token_id: int | None = hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """``text``'s ids without special tokens added (no BOS)."""
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int], skip_special_tokens: bool) -> list:
        return self.hf.convert_ids_to_tokens(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.hf.convert_tokens_to_string(tokens)

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> TextTokenizer:
    """Load the tokenizer in the folder ``path`` (no hub: a local path only), as vLLM's
    server does for ``--tokenizer-mode auto`` on a Hugging Face model.

    Raises TextError naming the path when there is no tokenizer there.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise TextError(f"tokenizer path {str(path)!r} is not a folder")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise TextError(
            f"{str(path)!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, ...):"
            " pass the folder that has them (a model whose tokenizer lives elsewhere, as"
            " `vllm serve --tokenizer PATH` names it)"
        )
    mistral = _mistral_tokenizer_files(folder)
    if mistral:
        raise TextError(
            f"{str(path)!r} holds a Mistral-format model ({', '.join(mistral)}): vLLM's"
            " tokenizer mode auto decodes it with mistral-common's tokenizer, whose text"
            " differs from the Hugging Face files beside it, and client.text reads only the"
            " latter; serve it with --tokenizer-mode hf to use those, or detokenize it with"
            " mistral-common yourself"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - the extra is not installed
        raise TextError(
            "text needs the client's `text` extra: pip install 'engine-gateway[text]'"
        ) from exc
    try:
        hf = AutoTokenizer.from_pretrained(
            str(folder),
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            truncation_side="left",
        )
    except Exception as exc:  # noqa: BLE001 - any file there may be malformed in any way
        raise TextError(
            f"no tokenizer could be loaded from {str(path)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(hf, bool) or not hasattr(hf, "convert_ids_to_tokens"):
        raise TextError(f"{str(path)!r} holds no tokenizer")
    return TextTokenizer(hf)


# What Hugging Face tokenizers are loaded from (any one of them makes a folder a candidate).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)


def _mistral_tokenizer_files(folder: Path) -> list[str]:
    """The files for which vLLM's tokenizer mode ``auto`` takes mistral-common's tokenizer
    (``is_mistral_model_repo``: a ``consolidated*.safetensors``, and a ``tekken.json`` or
    ``tokenizer.model.v*``), or none."""
    names = sorted(entry.name for entry in folder.iterdir())
    weights = fnmatch.filter(names, "consolidated*.safetensors")
    tokenizers = fnmatch.filter(names, "tekken.json") + fnmatch.filter(names, "tokenizer.model.v*")
    return weights[:1] + tokenizers if weights and tokenizers else []
