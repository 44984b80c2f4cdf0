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


def test_the_arena_is_made_once_its_pages_allocated_its_size_sealed_and_given_back(tmp_path):
    import fcntl
    import mmap

    import pytest

    from gateway.weight_buffers import ARENA_SEALS

    folder = WeightBufferFolder(str(tmp_path), arena_bytes=1 << 20)
    folder.make()
    path = folder.arena.make()
    assert path == f"/proc/{os.getpid()}/fd/{folder.arena._fd}"
    assert folder.arena.make() == path  # a later init: the same arena
    fd = os.open(path, os.O_RDWR)  # as a trainer or a worker opens it
    try:
        assert os.fstat(fd).st_size == 1 << 20
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & ARENA_SEALS == ARENA_SEALS
        for size in (0, 1 << 21):  # a trainer cannot shrink it under a worker, nor grow it
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with mmap.mmap(fd, 1 << 20) as mapping:
            mapping[:4] = b"abcd"
        assert os.pread(fd, 4, 0) == b"abcd"
        assert os.fstat(fd).st_blocks * 512 >= 1 << 20  # every page allocated up front
    finally:
        os.close(fd)
    folder.remove()
    assert folder.arena.path is None


def test_no_arena_where_the_operator_turned_it_off(tmp_path):
    assert WeightBufferFolder(str(tmp_path), arena_bytes=0).arena is None
