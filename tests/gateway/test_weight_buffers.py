"""The ``cpu`` backend's buffer folder: made private by the gateway, emptied when an update
ends, removed at the end, and a killed gateway's folder removed by the next one."""

from __future__ import annotations

import os
import subprocess
import sys

from gateway.weight_buffers import PREFIX, WeightBufferFolder


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_folder_is_private_named_after_the_gateway_and_reused(tmp_path):
    folder = WeightBufferFolder(str(tmp_path))
    path = folder.make()
    assert os.path.dirname(path) == str(tmp_path)
    assert os.path.basename(path).startswith(f"{PREFIX}{os.getpid()}-")
    assert os.stat(path).st_mode & 0o777 == 0o700
    for name in ("bucket-1", "bucket-2"):
        (tmp_path / os.path.basename(path) / name).write_bytes(b"x")
    os.mkdir(os.path.join(path, "sub"))
    assert folder.make() == path  # a later init: the same folder, emptied
    assert os.listdir(path) == []
    (tmp_path / os.path.basename(path) / "left").write_bytes(b"x")
    assert folder.empty() == 1 and os.listdir(path) == []
    folder.remove()
    assert not os.path.exists(path) and folder.path is None
    assert folder.empty() == 0


def test_a_dead_gateways_folder_is_removed_and_a_live_ones_or_anothers_kept(tmp_path):
    dead = tmp_path / f"{PREFIX}{_dead_pid()}-abc"
    alive = tmp_path / f"{PREFIX}{os.getppid()}-def"
    unrelated = tmp_path / f"{PREFIX}notapid"
    for kept_or_not in (dead, alive, unrelated):
        kept_or_not.mkdir()
        (kept_or_not / "bucket").write_bytes(b"x")
    WeightBufferFolder(str(tmp_path)).make()
    assert not dead.exists()
    assert alive.exists() and unrelated.exists()


def test_a_root_that_is_not_a_folder_is_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="not a folder"):
        WeightBufferFolder(str(tmp_path / "none")).make()
