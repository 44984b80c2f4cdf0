"""gateway.vllm.contract: the list of what the project relies on in vLLM is complete (every
``from vllm... import`` of the repository is in it), holds for the installed vLLM, and is
checked against the source of each release the project means to support, read from the
release's wheel (downloaded once into the cache, never installed) (issue 81 item 4)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.vllm.contract import ADAPTED, CONTRACT, RELEASES, check_installed, check_wheel, parse

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("ENGINE_GATEWAY_CACHE", Path.home() / ".cache/engine-gateway")) / (
    "vllm-wheels"
)


def _vllm_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` under gateway/, client/, bench/."""
    found = set()
    for folder in ("gateway", "client", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.ImportFrom)
                    and not node.level
                    and (node.module or "").split(".")[0] == "vllm"
                ):
                    found |= {(node.module, alias.name) for alias in node.names}
    return found


def test_every_vllm_import_of_the_repository_is_in_the_contract():
    listed = {(e.module, e.name) for e in map(parse, CONTRACT)}
    missing = sorted(_vllm_imports() - listed)
    assert not missing, f"add these to gateway/vllm/contract.py's CONTRACT: {missing}"
    assert len(CONTRACT) == len(set(CONTRACT))


def test_the_installed_vllm_keeps_the_contract():
    assert check_installed() == []


def test_the_source_reader_agrees_with_the_installed_release_and_catches_a_break():
    """Read as source, the installed release keeps every entry, as imported; an entry it
    does not keep (a field, a parameter, a class) is reported by name."""
    import vllm

    site = Path(vllm.__file__).parents[1]
    assert check_wheel(site) == []
    planted = [
        "vllm.v1.engine:EngineCoreOutput.no_such_field",
        "vllm.v1.engine.input_processor:InputProcessor.process_inputs(no_such_param)",
        "vllm.v1.engine.core:NoSuchClass",
    ]
    problems = check_wheel(site, planted)
    assert [p.split(":")[0] + ":" + p.split(":")[1] for p in problems] == planted
    assert check_installed(planted) and len(check_installed(planted)) == 3


def _wheel(release: str) -> Path:
    found = sorted(WHEELS.glob(f"vllm-{release}-*.whl"))
    if not found:
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "-q", "-d", str(WHEELS), f"vllm=={release}"],
            check=True, timeout=900,
        )  # fmt: skip
        found = sorted(WHEELS.glob(f"vllm-{release}-*.whl"))
    assert found, f"no wheel of vllm {release} in {WHEELS}"
    return found[0]


@pytest.mark.parametrize("release", RELEASES)
def test_each_release_meant_to_be_supported_keeps_the_contract_or_is_adapted(release):
    problems = check_wheel(_wheel(release))
    assert sorted(problems) == sorted(ADAPTED[release]), (
        f"vLLM {release} changes what the gateway relies on: adapt to each and list it in"
        f" ADAPTED: {problems}"
    )
