"""More vision-language architectures for the multimodal tests, tiny and random, each with
its processor and a local WordLevel tokenizer: PaliGemma (SigLIP 28 px, 4 image tokens;
Gemma) and BLIP-2 (ViT 28 px, a Q-Former's 4 query tokens; OPT)."""

from __future__ import annotations

import json
from pathlib import Path

PALIGEMMA_IMAGE_TOKEN = 599
BLIP2_IMAGE_TOKEN = 599


def _word_level(tokenizer_class, special: dict[str, int], **tokens: str):  # noqa: ANN202
    """A WordLevel tokenizer of 600 ids: ``special`` and ``t{i}`` for every other id."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(600) if i not in special.values()} | special
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer_class(tokenizer_object=words, unk_token="<unk>", **tokens)


def make_tiny_paligemma(folder: Path) -> Path:
    """Write the model to ``folder`` (once) and return it."""
    if (folder / "engine-gateway.json").exists():
        return folder
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        GemmaConfig,
        GemmaTokenizerFast,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessor,
        SiglipVisionConfig,
    )

    from gateway.tiny_model import _draw_weights

    special = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "\n": 598, "<image>": 599}
    tokenizer = _word_level(
        GemmaTokenizerFast, special, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = SiglipImageProcessor(size={"height": 28, "width": 28}, image_seq_length=4)
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)
    config = PaliGemmaConfig(
        vision_config=SiglipVisionConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14, projection_dim=64,
        ),
        text_config=GemmaConfig(
            vocab_size=600, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            max_position_embeddings=1024,
        ),
        image_token_index=PALIGEMMA_IMAGE_TOKEN, projection_dim=128, hidden_size=128,
        vocab_size=600,
    )  # fmt: skip
    config.text_config.num_image_tokens = 4
    model = PaliGemmaForConditionalGeneration(config)
    _draw_weights(model, 0, std=0.2)
    model.to(torch.bfloat16).save_pretrained(folder)
    processor.save_pretrained(folder)
    # vLLM 0.32 reads the SigLIP tower under vision_tower.vision_model.* and has no head.
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    renamed = {}
    for key, value in tensors.items():
        if ".head." in key and "vision_tower" in key:
            continue
        if key.startswith(("model.vision_tower.", "vision_tower.")) and "vision_model" not in key:
            key = key.replace("vision_tower.", "vision_tower.vision_model.", 1)
        renamed[key] = value
    save_file(renamed, weights, metadata={"format": "pt"})
    (folder / "engine-gateway.json").write_text(json.dumps({"model": "tiny-paligemma"}))
    return folder


def make_tiny_blip2(folder: Path) -> Path:
    """Write the model to ``folder`` (once) and return it."""
    if (folder / "engine-gateway.json").exists():
        return folder
    import torch
    from transformers import (
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        Blip2QFormerConfig,
        Blip2VisionConfig,
        BlipImageProcessorPil,
        OPTConfig,
        PreTrainedTokenizerFast,
    )

    from gateway.tiny_model import _draw_weights

    special = {"<pad>": 1, "</s>": 2, "<unk>": 3, "<image>": BLIP2_IMAGE_TOKEN}
    tokenizer = _word_level(
        PreTrainedTokenizerFast, special, bos_token="</s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.image_token = "<image>"
    images = BlipImageProcessorPil(size={"height": 28, "width": 28})
    processor = Blip2Processor(image_processor=images, tokenizer=tokenizer, num_query_tokens=4)
    config = Blip2Config(
        vision_config=Blip2VisionConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        ).to_dict(),
        qformer_config=Blip2QFormerConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
            encoder_hidden_size=64, vocab_size=600,
        ).to_dict(),
        text_config=OPTConfig(
            vocab_size=600, hidden_size=128, ffn_dim=256, num_hidden_layers=2,
            num_attention_heads=2, word_embed_proj_dim=128, max_position_embeddings=1024,
            pad_token_id=1, bos_token_id=2, eos_token_id=2,
        ).to_dict(),
        num_query_tokens=4, image_token_index=BLIP2_IMAGE_TOKEN,
    )  # fmt: skip
    model = Blip2ForConditionalGeneration(config)
    _draw_weights(model, 0, std=0.2)
    model.to(torch.bfloat16).save_pretrained(folder)
    processor.save_pretrained(folder)
    (folder / "engine-gateway.json").write_text(json.dumps({"model": "tiny-blip2"}))
    return folder
