"""Folders a client names (ReloadWeights' checkpoint, LoadLora's adapter), read only where
their files are regular files. A named pipe there blocked vLLM's read for good, and with it
every engine step; a link to a device such as /dev/zero made an adapter's copy endless,
and a sparse file (or a link to a huge one) filled the disk: an adapter is copied only when
it fits with room to spare.

Each file is opened here without blocking (``O_NONBLOCK``: a pipe opens at once) and checked
on its descriptor, so a name swapped for a pipe between a check and a read is caught too;
what is read afterwards is what was checked (a checkpoint: through links to this process's
descriptors, ``/proc/self/fd/N``; an adapter: copied from them). Links to regular files are
followed (a Hugging Face cache folder is made of them). Runs in vLLM's workers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator

__all__ = ["copy_regular_tree", "regular_files_linked", "spare_bytes"]

_KINDS = {
    stat.S_IFIFO: "a named pipe",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _open_checked(name: str, dir_fd: int, shown: str) -> tuple[int, os.stat_result]:
    """``name`` in ``dir_fd`` opened for reading, without blocking, following links; a
    descriptor of a regular file or a folder, else ValueError naming ``shown``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:  # a socket (ENXIO), a dangling link, no permission
        raise ValueError(f"{shown!r} cannot be read: {exc.strerror}") from None
    found = os.fstat(fd)
    if not (stat.S_ISREG(found.st_mode) or stat.S_ISDIR(found.st_mode)):
        os.close(fd)
        raise ValueError(f"{shown!r} is {_kind(found.st_mode)}, not a regular file")
    return fd, found


@contextlib.contextmanager
def regular_files_linked(folder: str) -> Iterator[str]:
    """Within: a private folder of links, one per regular file at the top of ``folder`` (by
    its name there) to this process's descriptor of it. Raises ValueError naming the first
    entry that is neither a regular file nor a folder. Left out: folders (vLLM reads a
    checkpoint's top level only) and empty files, which hold no weights; a kernel's
    pseudo-file (``/proc/kmsg``, a trace pipe) is a regular file of size 0 whose read may
    block for good. An adapter's copy reads each file up to its size, so none of those
    blocks it either."""
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    opened: list[int] = []
    linked = tempfile.mkdtemp(prefix="engine-gateway-checkpoint-")
    try:
        for name in sorted(os.listdir(dir_fd)):
            fd, found = _open_checked(name, dir_fd, os.path.join(folder, name))
            if not (stat.S_ISREG(found.st_mode) and found.st_size > 0):
                os.close(fd)
                continue
            opened.append(fd)
            os.symlink(f"/proc/self/fd/{fd}", os.path.join(linked, name))
        yield linked
    finally:
        shutil.rmtree(linked, ignore_errors=True)
        for fd in opened:
            os.close(fd)
        os.close(dir_fd)


def copy_regular_tree(source: str, destination: str) -> None:
    """Copy the folder ``source`` to ``destination`` (made here), each file read from the
    descriptor it was checked on, up to its size then. Every file is checked before a byte
    is written. Raises ValueError naming the first entry that is neither a regular file nor
    a folder, or a folder linked into itself, and ValueError where the files would not fit
    on ``destination``'s filesystem with room to spare (``spare_bytes``); OSError for a
    failed read or write (FileExistsError: ``destination`` is there already, and is left
    alone). Nothing this made is left at ``destination`` when it raises."""
    dir_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    entries: list[tuple[str, int, os.stat_result]] = []
    made = False
    try:
        _check_folder(dir_fd, source, "", entries, set())
        total = sum(found.st_size for _, _, found in entries if stat.S_ISREG(found.st_mode))
        parent = os.path.dirname(os.path.abspath(destination))
        free, spare = _room(parent)
        if total > free - spare:
            raise ValueError(
                f"{source!r} holds {total:,} bytes of files: more than {parent!r} can take "
                f"({free:,} bytes free, of which {spare:,} are kept free)"
            )
        os.mkdir(destination, 0o700)
        made = True
        for relative, fd, found in entries:
            _copy_entry(fd, found, os.path.join(destination, relative))
    except BaseException:
        if made:  # not a folder that was there before
            shutil.rmtree(destination, ignore_errors=True)
        raise
    finally:
        for _, fd, _ in entries:
            os.close(fd)
        os.close(dir_fd)


def spare_bytes(filesystem_bytes: int) -> int:
    """What an adapter's copy leaves free on a filesystem of ``filesystem_bytes``: 5% of it,
    at most 1 GiB, so that a client cannot fill the disk the engine and its host share."""
    return min(filesystem_bytes // 20, 1 << 30)


def _room(folder: str) -> tuple[int, int]:
    """Bytes free for an unprivileged writer in ``folder``'s filesystem, and the part of
    them to keep free."""
    found = os.statvfs(folder)
    return found.f_bavail * found.f_frsize, spare_bytes(found.f_blocks * found.f_frsize)


def _check_folder(
    dir_fd: int,
    shown: str,
    relative: str,
    entries: list[tuple[str, int, os.stat_result]],
    above: set[tuple[int, int]],
) -> None:
    """Open and check everything in the open folder ``dir_fd`` (its descriptor not kept),
    appending (path relative to the top, descriptor, its stat) to ``entries``: each folder
    before what it holds. ``above``: the folders it is in."""
    here = os.fstat(dir_fd)
    if (here.st_dev, here.st_ino) in above:
        raise ValueError(f"{shown!r} links to a folder it is in")
    for name in sorted(os.listdir(dir_fd)):
        fd, found = _open_checked(name, dir_fd, os.path.join(shown, name))
        entries.append((os.path.join(relative, name), fd, found))
        if stat.S_ISDIR(found.st_mode):
            inner = above | {(here.st_dev, here.st_ino)}
            _check_folder(fd, os.path.join(shown, name), entries[-1][0], entries, inner)


def _copy_entry(fd: int, found: os.stat_result, target: str) -> None:
    """Make ``target`` from the checked descriptor ``fd``: a folder, or a file's first
    ``found.st_size`` bytes."""
    if stat.S_ISDIR(found.st_mode):
        os.mkdir(target, 0o700)
        return
    with open(target, "xb") as out:
        left = found.st_size
        while left > 0:
            sent = os.sendfile(out.fileno(), fd, None, min(left, 1 << 30))
            if sent == 0:  # the file shrank since: what is left of it
                break
            left -= sent
