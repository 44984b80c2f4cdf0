"""Whether a child process has begun to exit, read from Linux's /proc.

A killed process's pipes (its multiprocessing sentinel among them) close only when its
last thread has torn down its memory. On this project's 2-core VM, in about one kill of
ten, that teardown waited 25 s in the kernel while a DP engine ran beside it: the thread in
state D in ``exit_mmap`` (``unlink_file_vma_batch_process``, waiting for a mapped file's
``i_mmap_rwsem``), which the VM's DAMON reclaim thread (``kdamond``, physical-address
monitoring with a pageout scheme) kept taking to walk that file's mappings. The main thread
had exited 3 ms after the kill. Watchers poll this beside the sentinel so that they see the
death when it happens."""

from __future__ import annotations

import signal

EXIT_POLL_S = 0.5  # how often watchers look; a few /proc reads each time
_PF_EXITING = 0x4  # include/linux/sched.h: the thread is in do_exit


def exit_status(pid: int) -> int | None:
    """``pid``'s exit status, once its main thread has begun to exit, in multiprocessing's
    form (a negative number: killed by that signal); None while it runs, and where /proc
    cannot tell (gone, not Linux): the process's sentinel reports those."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # Fields after the command name (which may hold any byte): state is field 3.
            fields = stat.read().rpartition(b")")[2].split()
        state, flags = fields[0], int(fields[6])  # fields 3 and 9 of proc(5)
    except (OSError, IndexError, ValueError):
        return None
    if state not in (b"Z", b"X") and not flags & _PF_EXITING:
        return None
    code = int(fields[49]) if len(fields) > 49 else 0  # field 52: as waitpid reports it
    return -(code & 0x7F) if code & 0x7F else code >> 8


# What a signal that killed an engine process says about the cause, beyond its name.
_SIGNAL_CAUSES = {
    signal.SIGILL: (
        "its CPU code path used an instruction this process may not run: on x86 with AMX,"
        " tile instructions the kernel was not asked to allow; elsewhere, one this CPU lacks"
    ),
    signal.SIGKILL: "killed outright (by a user, a supervisor or the kernel's OOM killer)",
    signal.SIGSEGV: "an invalid memory access in native code",
    signal.SIGBUS: "a bus error in native code (often shared memory /dev/shm full)",
    signal.SIGABRT: "native code aborted",
}


def describe_process_exit(name: str, code: int | None) -> str:
    """``name`` and how it ended, in multiprocessing's exit-code form: a negative code is
    the signal that killed it, named (with its usual cause) rather than numbered."""
    if code is None:
        return name
    if code >= 0:
        return f"{name} (exit status {code})"
    try:
        signum = signal.Signals(-code)
    except ValueError:
        return f"{name} (killed by signal {-code})"
    cause = _SIGNAL_CAUSES.get(signum)
    return f"{name} (killed by {signum.name}: {cause})" if cause else f"{name} ({signum.name})"
