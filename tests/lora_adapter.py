"""A tiny LoRA adapter for the tiny model, written as the PEFT files vLLM reads (no peft
package needed): rank-8 updates of q_proj and v_proj in every layer, seeded
(``bench.random_model.write_random_lora`` on the tiny model's config)."""

from __future__ import annotations

from pathlib import Path

from bench.random_model import write_random_lora
from gateway.tiny_model import ensure_tiny_model

RANK = 8


def make_tiny_lora(folder: Path, seed: int = 0) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder``."""
    return write_random_lora(ensure_tiny_model(), folder, rank=RANK, seed=seed)
