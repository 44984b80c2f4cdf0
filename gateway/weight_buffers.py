"""The folder a trainer writes the ``cpu`` weight-transfer backend's buffer files into.

Clients never name a folder (PROTOCOL.md §7.14): the gateway makes one at
InitWeightTransfer, under the operator's ``--weight-buffer-dir`` (default ``/dev/shm``),
private to the gateway's user (mode 0700), named after the gateway's pid, and answers with
its path. The engine's workers read only regular files directly in it. Files left behind
(a trainer that crashed) are removed when an update ends; the folder when the trainer
connection is shut down, when the gateway stops, and, after a gateway that was killed, by
the next gateway's InitWeightTransfer under the same root (its pid is gone).

Beside the folder, a ``WeightArena``: one block of shared memory of a fixed size, made once
(at the first InitWeightTransfer, under ``--weight-arena-mb``) with every page allocated,
that the trainer fills in place and the workers read as views, update after update, so
no page is faulted in again and no file is made per bucket. It is a sealed memfd (its size
can neither shrink nor grow: no reader can meet a truncated mapping), reached by its
``/proc/<gateway pid>/fd/<n>`` path: trainer and engines on this host, as this user.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

__all__ = [
    "ARENA_SEALS",
    "DEFAULT_ARENA_BYTES",
    "DEFAULT_ROOT",
    "PREFIX",
    "WeightArena",
    "WeightBufferFolder",
]

DEFAULT_ROOT = "/dev/shm"
PREFIX = "engine-gateway-weights-"
DEFAULT_ARENA_BYTES = 1 << 30
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class WeightArena:
    """A sealed shared-memory block of ``size`` bytes, every page allocated up front (the
    memory it costs is held from ``make`` until ``close``)."""

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"an arena needs a positive size, got {size}")
        self.size = size
        self._fd: int | None = None

    @property
    def path(self) -> str | None:
        """Where another process of this user opens it; None before ``make``."""
        return None if self._fd is None else f"/proc/{os.getpid()}/fd/{self._fd}"

    def make(self) -> str:
        """The arena's path, made on first use: a memfd of ``size`` bytes, its pages
        allocated (so neither the trainer's first write nor a worker's first read faults
        a page in from nothing), sealed against any change of size."""
        if self._fd is None:
            flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
            fd = os.memfd_create("engine-gateway-weight-arena", flags)
            try:
                os.ftruncate(fd, self.size)
                os.posix_fallocate(fd, 0, self.size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
        return self.path  # type: ignore[return-value]

    def close(self) -> None:
        """Give the memory back (once the last process that mapped it lets go)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WeightBufferFolder:
    """One gateway's buffer folder under ``root``: made on first use, emptied, removed."""

    def __init__(self, root: str = DEFAULT_ROOT, arena_bytes: int = DEFAULT_ARENA_BYTES):
        self.root = root
        self.path: str | None = None
        self.arena = WeightArena(arena_bytes) if arena_bytes > 0 else None

    def make(self) -> str:
        """The folder's path, made (and stale folders of dead gateways removed) if needed."""
        if self.path is not None and os.path.isdir(self.path):
            self.empty()
            return self.path
        if not os.path.isdir(self.root):
            raise ValueError(f"--weight-buffer-dir {self.root!r} is not a folder")
        self._remove_stale()
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.root)
        return self.path  # mkdtemp: mode 0700, owned by this user

    def empty(self) -> int:
        """Remove every file a trainer left in the folder; how many."""
        if self.path is None:
            return 0
        removed = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.path) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)
                    removed += 1
        return removed

    def remove(self) -> None:
        """Remove the folder and what is in it, and give the arena's memory back."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
        if self.arena is not None:
            self.arena.close()

    def _remove_stale(self) -> None:
        """Folders under the root made by gateways (of this user) whose process is gone."""
        uid = os.geteuid()
        with contextlib.suppress(OSError), os.scandir(self.root) as entries:
            for entry in entries:
                pid = _maker_pid(entry.name)
                if pid is None or pid == os.getpid() or _alive(pid):
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == uid:
                        shutil.rmtree(entry.path, ignore_errors=True)
                        logger.info("removed a dead gateway's weight buffers: %s", entry.path)


def _maker_pid(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    pid, _, rest = name[len(PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() and rest else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
