"""The tiny model is the same on every machine: its weights come from our own seeded
draw, not from transformers' initializers (which moved between releases)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from gateway.tiny_model import TINY_MODEL_CONFIG, ensure_tiny_model

# sha256 over every tensor's name and bytes, in name order (torch 2.13, bfloat16).
WEIGHTS_SHA256 = {
    0: "dcdd510e0778026a2ad8c46efd483ee802ad0254223ae4dd8c3e210a9e6f1170",
    1: "f352c982c686d5bf7a89e8793d459e1134b1f5b8f55fecdac606b17161d7cdb2",
}


def weights_digest(path: Path) -> str:
    import torch
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def test_two_builds_are_identical_and_pinned(tmp_path):
    for seed, expected in WEIGHTS_SHA256.items():
        first = weights_digest(ensure_tiny_model(tmp_path / "a", weights_seed=seed))
        second = weights_digest(ensure_tiny_model(tmp_path / "b", weights_seed=seed))
        assert first == second == expected, f"weights_seed={seed}"


def test_weights_are_drawn_as_transformers_would(tmp_path):
    import torch
    from safetensors.torch import load_file

    tensors = load_file(ensure_tiny_model(tmp_path) / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"].float()
    assert embed.shape == (TINY_MODEL_CONFIG["vocab_size"], TINY_MODEL_CONFIG["hidden_size"])
    assert abs(embed.std().item() - 0.02) < 0.002 and abs(embed.mean().item()) < 0.002
    norm = tensors["model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
