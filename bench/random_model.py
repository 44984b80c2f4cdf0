"""Random-weight checkpoints of real models' shapes, made locally (no model hub).

A frontend's cost depends on the model only through its shape: vocabulary size (token ids
on the wire, logprobs), EOS ids, context length, and the engine step time that the
weights' size sets. So a benchmark on a machine that cannot download weights runs on a
checkpoint of the real shape with random weights:

    python -m bench.random_model llama-3.2-1b ~/models/llama-3.2-1b-random
    python -m bench --model ~/models/llama-3.2-1b-random --targets gateway-ipc,vllm-http,direct

The config and generation config are the published ones of that model (architecture, vocab,
EOS ids, RoPE scaling, sampling defaults); the weights are drawn from one seeded generator,
one tensor at a time, and written as safetensors shards (memory stays at one tensor, not the
model). Outputs are meaningless text; greedy outputs are still deterministic.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "GENERATION_CONFIGS", "parameter_shapes", "write_random_model"]

_LLAMA3_ROPE = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA3 = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling=_LLAMA3_ROPE,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
    attention_bias=False,
    mlp_bias=False,
    torch_dtype="bfloat16",
)

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        _LLAMA3,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    ),
    "llama-3.2-3b": dict(
        _LLAMA3,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        _LLAMA3,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}

# The instruct models' generation_config.json (sampling defaults vLLM applies).
GENERATION_CONFIGS: dict[str, dict[str, Any]] = {
    name: dict(
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        do_sample=True,
        temperature=0.6,
        top_p=0.9,
    )
    for name in SHAPES
}

_SHARD_BYTES = 2 * 1024**3
_INIT_STD = 0.02  # the Llama configs' initializer_range


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint of ``config`` holds, by name (lm_head only when the
    embeddings are not tied), read from transformers' own model built on the meta device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def write_random_model(
    out: Path, config: dict[str, Any], generation_config: dict[str, Any], seed: int = 0
) -> int:
    """Write a checkpoint of ``config``'s shape with random weights to ``out``; return the
    parameter count. Norm scales are 1, matrices normal(0, 0.02) in bfloat16."""
    import torch
    from safetensors.torch import save_file

    shapes = parameter_shapes(config)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes):
        nbytes = math.prod(shapes[name]) * 2
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _draw(shapes[name], generator) for name in names}
        save_file(tensors, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(math.prod(s) for s in shapes.values())
    index = {"metadata": {"total_size": total * 2}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return total


def _draw(shape: tuple[int, ...], generator: Any) -> Any:
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    drawn = torch.empty(shape, dtype=torch.float32).normal_(0.0, _INIT_STD, generator=generator)
    return drawn.to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.random_model",
        description="Write a random-weight checkpoint of a real model's shape (no hub).",
    )
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path, help="the folder to write (vLLM's --model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.out / "config.json").exists():
        print(f"{args.out} already holds a model; remove it first", file=sys.stderr)
        return 2
    total = write_random_model(
        args.out, SHAPES[args.shape], GENERATION_CONFIGS[args.shape], args.seed
    )
    print(f"{args.shape}: {total / 1e9:.2f}B parameters written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def write_random_lora(
    model: Path, out: Path, rank: int = 8, seed: int = 0, b_scale: float = 1.0
) -> Path:
    """A PEFT adapter for the Llama checkpoint in ``model`` (its config.json): rank-``rank``
    updates of q_proj and v_proj in every layer, normal random (B times ``b_scale``), as
    vLLM reads them."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    outputs = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, size in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(size, rank, generator=generator) * b_scale
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(outputs),
        "base_model_name_or_path": str(model),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter))
    return out
