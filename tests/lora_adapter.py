"""A tiny LoRA adapter for the tiny model, written as the PEFT files vLLM reads (no peft
package needed): rank-8 updates of q_proj and v_proj in every layer, seeded."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.tiny_model import TINY_MODEL_CONFIG

RANK = 8


def make_tiny_lora(folder: Path, seed: int = 0) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder``."""
    import torch
    from safetensors.torch import save_file

    cfg = TINY_MODEL_CONFIG
    hidden = cfg["hidden_size"]
    outputs = {
        "q_proj": cfg["num_attention_heads"] * cfg["head_dim"],
        "v_proj": cfg["num_key_value_heads"] * cfg["head_dim"],
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, RANK, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(outputs),
                "base_model_name_or_path": "tiny-llama",
            }
        )
    )
    return folder
