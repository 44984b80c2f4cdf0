"""gateway.vllm.launch.set_engine_environment: what the engine processes inherit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.vllm.launch import set_engine_environment

MALLOC = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _config(backend: str | None) -> SimpleNamespace:
    transfer = None if backend is None else SimpleNamespace(backend=backend)
    return SimpleNamespace(weight_transfer_config=transfer)


@pytest.fixture
def clean_environment(monkeypatch):
    for name in (*MALLOC, "THP_MEM_ALLOC_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("backend", "kept"), [("cpu", True), (None, False), ("nccl", False)])
def test_glibc_keeps_freed_memory_only_for_cpu_weight_updates(clean_environment, backend, kept):
    """The CPU engine with the ``cpu`` weight-transfer backend (this machine is one) keeps
    the memory an update frees for the next; other engines return it as glibc does."""
    import os

    set_engine_environment(_config(backend))
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    assert all((name in os.environ) is kept for name in MALLOC)
    if kept:
        assert int(os.environ["MALLOC_MMAP_THRESHOLD_"]) >= 1 << 30


def test_an_operators_malloc_setting_wins(clean_environment):
    import os

    clean_environment.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    set_engine_environment(_config("cpu"))
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "131072"
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ
