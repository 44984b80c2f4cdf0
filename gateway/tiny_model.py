"""The embedded default model: a tiny random Llama, generated locally and cached.

Rule: deterministic (fixed seed, fixed config), so every machine builds the
same weights and greedy outputs are comparable across runs. The weights are drawn
here from a seeded generator, not by transformers' initializers, whose order and
defaults change between releases (v1 did, and its outputs moved with them). No hub
access.
Two EOS ids (2 and 3) so that multi-EOS handling is always exercised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "TINY_MODEL_CONFIG",
    "ensure_tiny_tokenizer",
    "make_byte_level_bpe",
    "TINY_EOS_TOKEN_IDS",
    "TINY_VLM_IMAGE_TOKEN",
    "default_cache_dir",
    "ensure_tiny_model",
    "ensure_tiny_vlm",
]

TINY_EOS_TOKEN_IDS = [2, 3]
TINY_MODEL_CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # CPU attention refuses head_dim < 32
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=TINY_EOS_TOKEN_IDS,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
_VERSION = "v2"


def default_cache_dir() -> Path:
    """Where the tiny model lives: $ENGINE_GATEWAY_CACHE or ~/.cache/engine-gateway."""
    root = os.environ.get("ENGINE_GATEWAY_CACHE") or Path.home() / ".cache" / "engine-gateway"
    return Path(root)


def ensure_tiny_model(cache_dir: Path | None = None, weights_seed: int = 0) -> Path:
    """Return the path of the tiny model, generating it on first use.

    ``weights_seed``: another weight set of the same shape (weight-reload tests).
    """
    name = f"tiny-llama-{_VERSION}" + (f"-seed{weights_seed}" if weights_seed else "")
    path = (cache_dir or default_cache_dir()) / name
    marker = path / "engine-gateway.json"
    if marker.exists():
        return path
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_MODEL_CONFIG)
    model = LlamaForCausalLM(config)
    _draw_weights(model, weights_seed, std=config.initializer_range)
    generation = GenerationConfig(
        bos_token_id=1, eos_token_id=TINY_EOS_TOKEN_IDS, max_new_tokens=None
    )
    return _publish(path, _VERSION, model.to(torch.bfloat16), generation)


def _publish(path: Path, version: str, *parts: Any) -> Path:
    """Save ``parts`` (anything with ``save_pretrained``) into a private folder, then rename it
    to ``path``, marked by ``version``: a reader never sees half a model."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    for part in parts:
        part.save_pretrained(tmp)
    (tmp / "engine-gateway.json").write_text(json.dumps({"version": version}))
    try:
        tmp.rename(path)
    except OSError:  # another process won the race; use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


TINY_VLM_IMAGE_TOKEN = 6
_VLM_VERSION = "v1"
_VLM_SPECIAL = ["<unk>", "<s>", "</s>", "<end_of_utterance>", "<fake_token_around_image>"]
_VLM_SPECIAL += ["<global-img>", "<image>", "\n"]
_VLM_SPECIAL += [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]


def ensure_tiny_vlm(cache_dir: Path | None = None) -> Path:
    """Return the path of a tiny random Idefics3 (SmolVLM's architecture: SigLIP, pixel
    shuffle, Llama), generating it on first use, with its image processor and a local
    WordLevel tokenizer (ids 0-43 special, ``t44`` .. ``t511`` plain words; ``<image>`` is
    ``TINY_VLM_IMAGE_TOKEN``). Images are resized to a longest edge of 112 and cut into
    56-pixel tiles plus a global view, 4 image tokens each: up to 20 per image."""
    path = (cache_dir or default_cache_dir()) / f"tiny-idefics3-{_VLM_VERSION}"
    marker = path / "engine-gateway.json"
    if marker.exists():
        return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    vocab = {token: i for i, token in enumerate(_VLM_SPECIAL)}
    vocab.update({f"t{i}": i for i in range(len(vocab), 512)})
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    images = Idefics3ImageProcessorPil(
        do_image_splitting=True,
        size={"longest_edge": 112},
        max_image_size={"longest_edge": 56},
    )
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4)
    config = Idefics3Config(
        vision_config=Idefics3VisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=56,
            patch_size=14,
        ),
        text_config=LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=2048,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        image_token_id=TINY_VLM_IMAGE_TOKEN,
        scale_factor=2,
        vocab_size=512,
        pad_token_id=0,
    )
    model = Idefics3ForConditionalGeneration(config)
    _draw_weights(model, 0, std=0.05)
    generation = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _publish(path, _VLM_VERSION, model.to(torch.bfloat16), processor, generation)


def _draw_weights(model: Any, seed: int, std: float) -> None:
    """Every parameter from one seeded float64 stream, in name order: biases 0, norm
    scales 1, matrices normal(0, std), as transformers initializes a Llama."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.dim() == 1 and name.endswith(".bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                drawn = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                param.copy_(drawn * std)


_TOKENIZER_VERSION = "v1"
_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like"
)
_MULTIBYTE = "café naïve 日本語 中文字符 東京 😀 🎉 Ωmega ß مرحبا привет 한국어 €100 — … </answer>"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_byte_level_bpe(vocab_size: int) -> Any:
    """A byte-level BPE of at most ``vocab_size`` ids trained here (seeded text with words
    and multi-byte characters), ids 0-2 ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``
    (the EOS), and a ChatML chat template: a Hugging Face tokenizer (``save_pretrained``)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = _WORDS.split() + _MULTIBYTE.split() + ["\nObservation:"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(3000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(lines, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def ensure_tiny_tokenizer(cache_dir: Path | None = None) -> Path:
    """A tokenizer for the tiny model (for text in the client: ``client.text``): a byte-level
    BPE of exactly its 512 ids, generated on first use. The gateway never needs it."""
    path = (cache_dir or default_cache_dir()) / f"tiny-llama-tokenizer-{_TOKENIZER_VERSION}"
    if (path / "engine-gateway.json").exists():
        return path
    vocab_size = TINY_MODEL_CONFIG["vocab_size"]
    return _publish(path, _TOKENIZER_VERSION, make_byte_level_bpe(vocab_size))


if __name__ == "__main__":
    print(ensure_tiny_model())
