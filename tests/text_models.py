"""Real tokenizers and tiny models that fit them, made locally (no hub), for the text tests.

- ``bpe``: a byte-level BPE trained here with ``tokenizers`` on text full of multi-byte
  characters (accents, CJK, emoji, Arabic, Cyrillic, Korean), with a ChatML template
  (gateway.tiny_model.make_byte_level_bpe, up to 1024 ids); its model has two
  end-of-sequence ids (``<|im_end|>``, ``<|endoftext|>``).
- ``sp``: the 32k SentencePiece model that mistral-common ships (byte fallback), as a
  fast tokenizer (transformers' LlamaTokenizer) and as a slow, Python one
  (BertGenerationTokenizer), with an ``[INST]`` template.
Each model is a tiny random Llama whose vocabulary is the tokenizer's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gateway.tiny_model import (
    TINY_MODEL_CONFIG,
    _draw_weights,
    _publish,
    default_cache_dir,
    make_byte_level_bpe,
)

_VERSION = "v2"
INST = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ m['content'] }}{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]"
    "{% endif %}{% endfor %}"
)


def _sentencepiece_file() -> Path:
    import mistral_common

    return (
        Path(mistral_common.__file__).parent / "data" / "mistral_instruct_tokenizer_240323.model.v3"
    )


def write_gptsw3_tokenizer(folder: Path) -> None:
    """A slow SentencePiece tokenizer whose byte-fallback pieces decode to bytes, so that a
    character split over them reads U+FFFD until its last byte (GPT-SW3's)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(_sentencepiece_file(), folder / "spiece.model")
    config = {
        "tokenizer_class": "GPTSw3Tokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_sentencepiece_tokenizer(folder: Path, *, slow: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(_sentencepiece_file(), folder / "tokenizer.model")
    config = {
        "tokenizer_class": "BertGenerationTokenizer" if slow else "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": INST,
    }
    if slow:
        config["pad_token"] = "<pad>"
    else:
        config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_wordpiece_tokenizer(folder: Path) -> None:
    """A small BERT-style WordPiece (a fast tokenizer whose decoder puts spaces between
    tokens, added tokens too: what ``spaces_between_special_tokens`` acts on)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat"]
    words += ["##s", "##ing", "##ed", "café", "東", "京", "!", ",", "hello", "world", "##é"]
    wordpiece = Tokenizer(models.WordPiece(vocab={w: i for i, w in enumerate(words)}))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        pad_token="[PAD]", mask_token="[MASK]",
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>", "</tool>"]})
    tokenizer.save_pretrained(folder)


def ensure_tokenizer(kind: str, cache_dir: Path | None = None) -> Path:
    """The folder of tokenizer ``kind``: ``bpe``, ``sp-fast``, ``sp-slow``, ``gptsw3`` or
    ``wordpiece``."""
    path = (cache_dir or default_cache_dir()) / f"tokenizer-{kind}-{_VERSION}"
    if (path / "engine-gateway.json").exists():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if kind == "bpe":
        make_byte_level_bpe(1024).save_pretrained(tmp)
    elif kind == "wordpiece":
        write_wordpiece_tokenizer(tmp)
    elif kind == "gptsw3":
        write_gptsw3_tokenizer(tmp)
    else:
        write_sentencepiece_tokenizer(tmp, slow=kind == "sp-slow")
    (tmp / "engine-gateway.json").write_text(json.dumps({"version": _VERSION}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def ensure_text_model(kind: str, cache_dir: Path | None = None) -> Path:
    """A tiny random Llama with tokenizer ``kind`` beside it (vocabulary = the tokenizer's)."""
    path = (cache_dir or default_cache_dir()) / f"tiny-llama-{kind}-{_VERSION}"
    if (path / "engine-gateway.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = ensure_tokenizer(kind, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = [tokenizer.eos_token_id]
    if kind == "bpe":
        eos.append(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos[0]
    config = LlamaConfig(
        **{**TINY_MODEL_CONFIG, "vocab_size": len(tokenizer), "bos_token_id": bos,
           "eos_token_id": eos},
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    _draw_weights(model, 0, std=config.initializer_range)
    generation = GenerationConfig(bos_token_id=bos, eos_token_id=eos)
    path = _publish(path, _VERSION, model.to(torch.bfloat16), generation)
    for name in (tokenizer_dir).iterdir():
        if name.name != "engine-gateway.json":
            shutil.copy(name, path / name.name)
    return path
