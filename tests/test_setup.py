"""The set-up script says what it installed (issue 72 item 7): which torch build, CPU or
CUDA. Run on the venv the suite runs in (idempotent: nothing is installed again)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_says_which_torch_build_it_installed():
    done = subprocess.run(
        ["scripts/setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    import torch

    kind = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    assert f"setup: torch {torch.__version__} {kind} build" in done.stdout, done.stdout
    assert ("setup: warning" in done.stderr) == (torch.version.cuda is not None)
    assert "engine-gateway env ready" in done.stdout
