"""TRL 1.16's ``GRPOTrainer`` (``vllm_mode="server"``), as released, on the CPU with the tiny
model, its vLLM client swapped for ``client.frameworks.trl.GatewayVLLMClient`` (the one line
a script adds), in ``.venv-trl`` with the repository on PYTHONPATH.

    .venv-trl/bin/python tests/client/http_face/trl_grpo.py GATEWAY MODEL_DIR TOKENIZER_DIR OUT

After each weight sync the client records what it pushed (saved as a checkpoint under OUT,
for the test's offline vLLM), the version, and the gateway's greedy output then. Prints one
JSON line: the syncs and the trainer's logged losses; or the error raised.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

PROBE = [5, 6, 7, 8]  # the prompt whose greedy output is recorded after each sync


def main() -> None:
    address, model_dir, tokenizer_dir, out = sys.argv[1:5]
    try:
        print(json.dumps(train(address, Path(model_dir), tokenizer_dir, Path(out))))
    except Exception as exc:  # TRL's or the adapter's error, for the test to read
        import traceback

        traceback.print_exc()
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))


def train(address: str, model_dir: Path, tokenizer_dir: str, out: Path) -> dict:
    import torch
    import trl.generation.vllm_generation
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from client.frameworks.trl import GatewayVLLMClient
    from codec import SamplingParams

    syncs: list[dict] = []

    class Recording(GatewayVLLMClient):
        def update_named_params(self, metadata, named_params, **kwargs):  # noqa: ANN001
            pushed = [(name, tensor.detach().clone()) for name, tensor in named_params]
            super().update_named_params(metadata, pushed, **kwargs)
            folder = out / f"sync-{len(syncs) + 1}"
            folder.mkdir(parents=True)
            save_file({n: t.float().contiguous() for n, t in pushed}, folder / "model.safetensors")
            for name in ("config.json", "generation_config.json"):
                shutil.copy(model_dir / name, folder / name)
            greedy = self.client.complete(PROBE, SamplingParams(temperature=0.0, max_tokens=16))
            syncs.append(
                {
                    "version": self.weight_versions[-1],
                    "checkpoint": str(folder),
                    "greedy": greedy.token_ids,
                    "spans": [s.version for s in greedy.weight_versions or []],
                }
            )

    trl.generation.vllm_generation.VLLMClient = Recording  # the one line a script adds

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = Dataset.from_dict({"prompt": [f"count {i} apples" for i in range(8)]})

    def reward(completions: list[str], **_: object) -> list[float]:
        return [float(len(set(c))) for c in completions]  # any signal: steps change weights

    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=address,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=5e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        vllm_importance_sampling_correction=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
    )
    trainer.train()
    # The trainer's weights after its last step, pushed once more (TRL syncs before each
    # generation, so the last step's weights were not sent yet).
    trainer.vllm_generation.sync_weights()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"syncs": syncs, "losses": losses, "steps": trainer.state.global_step}


if __name__ == "__main__":
    main()
