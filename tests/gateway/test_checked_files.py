"""Folders a client names are read only where their files are regular files, from the
descriptor each was checked on: a named pipe or a device is refused by name without
blocking, and a name swapped afterwards changes nothing that is read."""

from __future__ import annotations

import contextlib
import os

import pytest

from gateway.vllm.checked_files import copy_regular_tree, regular_files_linked

pytestmark = pytest.mark.timeout(20)  # a pipe opened without O_NONBLOCK would block for good


def _checkpoint(folder):
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "blob").write_bytes(b"linked")
    (folder / "config.json").symlink_to(folder / "blob")  # a Hugging Face cache's links
    (folder / "sub").mkdir()
    (folder / "empty.safetensors").symlink_to("/proc/self/stat")  # says size 0
    return folder


def test_a_checkpoint_is_read_through_links_to_the_files_checked(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt")
    with regular_files_linked(str(folder)) as linked:
        # Not the empty file: a pseudo-file such as /proc/kmsg says size 0, and blocks reads.
        assert sorted(os.listdir(linked)) == ["blob", "config.json", "model.safetensors"]
        # Swapped for a pipe after the check: what is read is still the file checked.
        os.remove(folder / "model.safetensors")
        os.mkfifo(folder / "model.safetensors")
        with open(os.path.join(linked, "model.safetensors"), "rb") as f:
            assert f.read() == b"weights"
        assert (tmp_path / "ckpt" / "blob").read_bytes() == b"linked"
        assert os.readlink(os.path.join(linked, "config.json")).startswith("/proc/self/fd/")
    assert not os.path.exists(linked)


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda path: os.mkfifo(path), "is a named pipe, not a regular file"),
        (lambda path: os.symlink("/dev/zero", path), "is a character device"),
        (lambda path: os.symlink("/no/such/file", path), "cannot be read"),
    ],
    ids=["pipe", "device", "dangling"],
)
def test_a_pipe_a_device_or_a_dangling_link_is_refused_by_name(tmp_path, make, named):
    folder = _checkpoint(tmp_path / "ckpt")
    make(str(folder / "model-2.safetensors"))
    with pytest.raises(ValueError, match=named) as refused, regular_files_linked(str(folder)):
        pass
    assert "model-2.safetensors" in str(refused.value)
    adapter = tmp_path / "adapter"
    with pytest.raises(ValueError, match=named):
        copy_regular_tree(str(folder), str(adapter))
    assert not adapter.exists()


def test_an_adapter_folder_is_copied_whole_and_a_link_loop_is_refused(tmp_path):
    folder = _checkpoint(tmp_path / "adapter")
    (folder / "sub" / "inner.bin").write_bytes(b"inner")
    copy = tmp_path / "copy"
    copy_regular_tree(str(folder), str(copy))
    assert (copy / "model.safetensors").read_bytes() == b"weights"
    assert (copy / "config.json").read_bytes() == b"linked" and not (
        copy / "config.json"
    ).is_symlink()
    assert (copy / "sub" / "inner.bin").read_bytes() == b"inner"
    assert (copy / "empty.safetensors").read_bytes() == b""  # read up to its size: nothing
    (folder / "sub" / "loop").symlink_to(folder)
    with pytest.raises(ValueError, match="links to a folder it is in"):
        copy_regular_tree(str(folder), str(tmp_path / "again"))
    assert not (tmp_path / "again").exists()


@contextlib.contextmanager
def writes_capped():
    """Within: files this process writes stop at 64 MiB (EFBIG, not a signal), so a copy
    that should have been refused fails fast instead of filling the disk."""
    import resource
    import signal

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("beyond", ["the disk", "the spare room"])
def test_an_adapter_too_big_for_the_copies_filesystem_is_refused_before_a_write(tmp_path, beyond):
    from gateway.vllm.checked_files import spare_bytes

    found = os.statvfs(tmp_path)
    free, size = found.f_bavail * found.f_frsize, found.f_blocks * found.f_frsize
    folder = _checkpoint(tmp_path / "adapter")
    # Sparse: says its size, holds nothing (a link to a huge file does the same).
    big = size + (1 << 30) if beyond == "the disk" else free - spare_bytes(size) // 2
    os.truncate(folder / "model.safetensors", big)
    copy = tmp_path / "copy"
    with writes_capped(), pytest.raises(ValueError, match="bytes of files: more than") as refused:
        copy_regular_tree(str(folder), str(copy))
    assert str(folder) in str(refused.value) and "kept free" in str(refused.value)
    assert not copy.exists()
    os.truncate(folder / "model.safetensors", 1 << 20)
    copy_regular_tree(str(folder), str(copy))
    assert (copy / "model.safetensors").stat().st_size == 1 << 20


def test_the_spare_room_is_five_percent_of_a_filesystem_at_most_one_gib():
    from gateway.vllm.checked_files import spare_bytes

    assert spare_bytes(10 << 30) == (10 << 30) // 20
    assert spare_bytes(100 << 30) == 1 << 30


def test_a_copy_onto_a_folder_already_there_leaves_that_folder_alone(tmp_path):
    folder = _checkpoint(tmp_path / "adapter")
    there = tmp_path / "there"
    there.mkdir()
    (there / "kept").write_bytes(b"kept")
    with pytest.raises(FileExistsError):
        copy_regular_tree(str(folder), str(there))
    assert (there / "kept").read_bytes() == b"kept"
